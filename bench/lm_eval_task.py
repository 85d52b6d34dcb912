"""``mlxpipe bench quality --task``: an lm-evaluation-harness task of your own, scored
through a server at each setting asked for, so that 3-bit, 4-bit and ``--bits auto``
can be weighed on the questions that matter to you, not on a fixed text.

For each setting a server is started (``mlxpipe serve --model SRC --bits B``, greedy
by default) and lm-evaluation-harness runs the task against it with its
``local-completions`` model (token ids, the server's own tokenizer: loglikelihood
tasks are scored by the last stage from the prompt's log-probabilities, and
generation tasks generate); ``--url`` scores a server already running instead
(whatever it serves). lm-eval is not a dependency of mlxpipe: ``pip install
'lm-eval[api]'`` (no torch needed).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from importlib.util import find_spec
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from mlxpipe.bench.common import HttpServer
from mlxpipe.server.cli.options import table


def task_of(task: str, include_path: Optional[str]) -> Tuple[str, Optional[str]]:
    """(task name, folder lm-eval includes): a task YAML's path names both (its ``task:``
    line and its folder); any other name is a task lm-eval knows or finds under
    ``include_path``."""
    path = Path(task)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        found = re.search(r"^task:\s*['\"]?([^'\"\s]+)", path.read_text(), re.MULTILINE)
        if not found:
            raise SystemExit(f"mlxpipe bench quality: {task} has no 'task:' line")
        return found.group(1), include_path or str(path.resolve().parent)
    return task, include_path


def lm_eval(url: str, tokenizer: Path, task: str, include_path: Optional[str], limit: Optional[int] = None,
            batch: int = 1) -> Dict[str, float]:
    """lm-eval's aggregate metrics for ``task`` through the server at ``url`` ({"acc,none": 0.6, ...})."""
    with tempfile.TemporaryDirectory() as out:
        args = (f"model=default,base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={tokenizer},"
                f"tokenized_requests=True,num_concurrent={batch},max_retries=1")
        cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
               "--tasks", task, "--output_path", out]
        cmd += ["--include_path", include_path] if include_path else []
        cmd += ["--limit", str(limit)] if limit else []
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"lm-eval failed ({run.returncode}):\n{run.stderr[-3000:]}")
        (results,) = Path(out).rglob("results_*.json")
        metrics = json.loads(results.read_text())["results"][task]
    return {k: v for k, v in metrics.items()
            if isinstance(v, (int, float)) and "_stderr" not in k and k != "sample_len"}


def serve_command(model: Path, setting: str, stages: int) -> List[str]:
    bits = [] if setting in ("bf16", "full", "as-stored") else ["--bits", setting]
    return [sys.executable, "-m", "mlxpipe.server.cli", "serve", "--port", "0", "--model", str(model),
            "--stages", str(stages), "--temp", "0", *bits]


def bench_task(args, model: Path) -> dict:
    """Score the task at each setting (or once, through ``--url``); print a table."""
    if find_spec("lm_eval") is None:
        raise SystemExit("mlxpipe bench quality --task needs lm-evaluation-harness: pip install 'lm-eval[api]'")
    task, include = task_of(args.task, args.include_path)
    settings = ["served"] if args.url else [s.strip() for s in args.settings.split(",") if s.strip()]
    rows = []
    for setting in settings:
        server = None if args.url else HttpServer(f"mlxpipe --bits {setting}", serve_command(model, setting,
                                                                                              args.stages))
        try:
            url = args.url.removesuffix("/v1") if args.url else server.url
            rows.append({"setting": setting, "metrics": lm_eval(url, model, task, include, args.limit)})
        finally:
            if server is not None:
                server.close()
    names = sorted({k for r in rows for k in r["metrics"]})
    out = [["setting", *names]] + [[r["setting"], *(f"{r['metrics'].get(n, float('nan')):.4f}" for n in names)]
                                   for r in rows]
    print(f"{task} through mlxpipe serve ({args.url or f'{model.name}, stages: {args.stages}, greedy'}):")
    print(table(out, right=range(1, len(names) + 1)))
    return {"model": str(model), "task": task, "rows": rows}

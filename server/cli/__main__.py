"""``python -m mlxpipe.server.cli``: the ``mlxpipe`` command."""

import sys

from mlxpipe.server.cli.main import main

sys.exit(main())

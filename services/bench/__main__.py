"""``python -m services.bench``: the same as ``llmesh bench``."""

import sys

from services.bench.main import main

sys.exit(main())

"""The elastic KV tests import ``kv_sim`` (the scheduler stand-in) from this folder."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

"""Where the tests find the repository, its books and the real default model."""

import os
from pathlib import Path

# Where the real default model lives, captured before any test redirects the home.
REAL_HOME = os.environ.get("MLX_STREAM_HOME")
REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "benchmarks" / "data"  # public-domain books carried by the repository

"""Settings for the whole test run."""

import os

# Compiled functions called without torch's guard check (mappo.compiled.DirectCalls) check the
# guards before every call in the tests, and fail where the caller's key missed a change.
os.environ.setdefault("MAPPO_GUARD_CHECK_EVERY", "1")

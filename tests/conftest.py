"""Settings for the whole test run."""

import os

# Compiled functions called without torch's guard check (mappo.compiled.DirectCalls) check the
# guards before every call in the tests, and fail where the caller's key missed a change.
os.environ.setdefault("MAPPO_GUARD_CHECK_EVERY", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _trusted_modules_per_test():
    """Modules trusted in a test (``--import``, or the module a test trained on) stay trusted
    in that test only, so that no test's refusal depends on which tests ran before it."""
    from mappo.envs import registry

    before = set(registry._TRUSTED)
    yield
    registry._TRUSTED.clear()
    registry._TRUSTED.update(before)

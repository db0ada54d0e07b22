"""The shipped policies, loaded once."""

import pytest

from supervisor.judge.policy import BUILTIN_POLICY_DIR, load_policy


@pytest.fixture(scope="session")
def default_policy():
    return load_policy("default", search_dirs=[BUILTIN_POLICY_DIR])


@pytest.fixture(scope="session")
def conservative_policy():
    return load_policy("conservative", search_dirs=[BUILTIN_POLICY_DIR])


@pytest.fixture(scope="session")
def long_context_policy():
    return load_policy("long-context", search_dirs=[BUILTIN_POLICY_DIR])

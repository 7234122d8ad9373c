"""How many examples a costly property test draws.

A test that trains on several ranks per example sets its own, smaller `max_examples`, which
overrides every profile: without this, `HYPOTHESIS_PROFILE=thorough` would run it with its CI
count. `examples(n)` is `n` under the CI profile (the default) and `THOROUGH_FACTOR * n` under
"thorough", the ratio of the two profiles' counts.
"""

from __future__ import annotations

import os

CI_EXAMPLES = 8
THOROUGH_EXAMPLES = 100
THOROUGH_FACTOR = THOROUGH_EXAMPLES // CI_EXAMPLES


def profile() -> str:
    """The hypothesis profile this session loads: conftest.py loads the one named here."""
    return os.environ.get("HYPOTHESIS_PROFILE", "ci")


def examples(count: int) -> int:
    """`count` examples under the CI profile, `THOROUGH_FACTOR` times as many under "thorough"."""
    return count * THOROUGH_FACTOR if profile() == "thorough" else count

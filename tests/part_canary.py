"""A canary for tests/test_parts.py: importing it leaves a mark, so a test sees whether a file made graphgrow import a
name it stores."""

import os

os.environ["GRAPHGROW_PART_CANARY"] = "imported"


def make():  # pragma: no cover - never called: the test fails if this module is even imported
    raise AssertionError("a stored name was called")

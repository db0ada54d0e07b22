"""What Python 3.11 added that the daemon and CLI use, for Python 3.10 (Ubuntu 22.04, a common
ROCm host). Pure; the job's own environment is the job's business."""

from __future__ import annotations

import sys
from enum import Enum

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:
    class StrEnum(str, Enum):
        """enum.StrEnum of 3.11: members are their values as strings (str(), format(), ==)."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return format(str(self.value), spec)

        @staticmethod
        def _generate_next_value_(name: str, start: int, count: int, last_values: list) -> str:
            return name.lower()

__all__ = ["StrEnum"]

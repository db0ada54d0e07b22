"""The numbers blew up: the loss scale at its floor, NaN/inf detected or logged."""

from __future__ import annotations

import re

from supervisor.core.models import Category
from supervisor.judge.diagnosis.hits import HINT, ROOT, Hit, Segment

# --- numeric --------------------------------------------------------------
_LOSS_SCALE_MIN_RE = re.compile(r"Current loss scale already at minimum")
_NAN_DETECTED_RE = re.compile(
    r"returned nan values in its \d+\w* output|[Ll]oss is (?:nan|NaN|inf)\b|[Ll]oss became (?:NaN|nan|inf)|non-finite loss"
    # Keras' TerminateOnNaN; TensorFlow's CheckNumerics; Megatron's rerun state machine
    r"|Invalid loss, terminating training|Tensor had (?:NaN|Inf) values|found NaN in (?:local )?grad norm"
)
_NAN_LOSS_RE = re.compile(r"""['"]loss['"]:\s*(?:nan|-?inf)\b|loss\w*\s*[=:]\s*(?:nan|-?inf)\b""")


def find(seg: Segment, t: str, exc: str | None, exc_form: bool, hits: list[Hit]) -> None:
    """Append this family's hits for one segment (`t` its text, `exc` its short exception class)."""
    # Numeric.
    if _LOSS_SCALE_MIN_RE.search(t):
        hits.append(Hit("loss_scale_min", Category.NUMERIC, ROOT, "loss_scale_at_minimum", exc=seg.exc))
    elif _NAN_DETECTED_RE.search(t):
        # Said outside an exception: structural only as the final error of the log (a *_mention).
        hits.append(Hit("nan_detected" if exc_form else "nan_detected_mention", Category.NUMERIC,
                        ROOT if exc_form else HINT, "nan_detected", exc=seg.exc))
    elif ("nan" in t or "inf" in t) and _NAN_LOSS_RE.search(t):
        hits.append(Hit("nan_loss", Category.NUMERIC, HINT, "nan_loss"))

"""The numbers blew up: the loss scale at its floor, NaN/inf detected or logged."""

from __future__ import annotations

import re

from supervisor.core.models import Category
from supervisor.judge.diagnosis.hits import HINT, ROOT, Hit, Segment

# --- numeric --------------------------------------------------------------
# DeepSpeed's loss_scaler.py; fairseq's dynamic_loss_scaler.py (and its forks: "AMP: Minimum loss scale reached")
_LOSS_SCALE_MIN_RE = re.compile(r"Current loss scale already at minimum|Minimum loss scale reached")
_NAN_DETECTED_RE = re.compile(
    r"returned nan values in its \d+\w* output|[Ll]oss is (?:nan|NaN|inf)\b|[Ll]oss became (?:NaN|nan|inf)|non-finite loss"
    # Keras' TerminateOnNaN; TensorFlow's CheckNumerics and NanTensorHook; Megatron's loss and grad-norm checks
    r"|Invalid loss, terminating training|Tensor had (?:NaN|Inf) values|NaN loss during training"
    r"|found (?:NaN|Inf|nan|inf) in (?:local )?(?:grad norm|forward loss|loss|grad)"
    # torch: clip_grad_norm_(error_if_nonfinite=True); multinomial over NaN logits; a distribution's
    # parameter computed from NaN weights (distributions/distribution.py)
    r"|is non-finite, so it cannot be clipped|probability tensor contains either `inf`, `nan` or element < 0"
    r"|to (?:satisfy the constraint|be within the support) .{0,200}but found invalid values"
    # Lightning's EarlyStopping(check_finite=True) and a program's own stop in the usual words
    r"|Monitored metric \S+ = (?:nan|-?inf) is not finite"
    r"|\b(?:NaN|nan|Inf|inf|non-finite) (?:loss|gradients?|grad norm)(?:es)? (?:detected|encountered|found)"
    r"|\b[Ll]oss (?:was|has become|went|turned|returned in \S+ is) (?:nan|NaN|inf|-inf|infinite|non-finite)\b"
    # scikit-learn's _assert_all_finite (a metric over NaN outputs), tensorboardX's check_nan warning,
    # Python's int() of a NaN/inf loss or step count
    r"|\bInput (?:\w+ )?contains (?:NaN|infinity)|NaN or Inf found in input tensor"
    r"|cannot convert float (?:NaN|infinity) to integer"
    # Lightning's detect_nan_parameters (utilities/finite_checks.py); scipy's _asarray_validated and
    # numpy.linalg's _assert_finite refusing NaN/inf input
    r"|Detected nan and/or inf values in|[Aa]rray must not contain infs or NaNs"
)
# Classes only a non-finite number raises: numpy's seterr and every trainer built on it (fairseq,
# detectron2), TensorFlow's NanLossDuringTrainingError.
_NUMERIC_CLASS_RE = re.compile(r"^FloatingPointError$|^Nan\w*Error$|^NonFinite\w*Error$")
_NAN_LOSS_RE = re.compile(r"""['"]loss['"]:\s*(?:nan|-?inf)\b|loss\w*\s*[=:]\s*(?:nan|-?inf)\b""")


# A traceback's code line that asserts the numbers are finite (`assert not torch.isnan(loss).any()`,
# `assert np.isfinite(x).all()`): the bare AssertionError under it is that check failing.
_FINITE_ASSERT_RE = re.compile(r"^assert\b.*\b(?:isnan|isinf|isfinite|isneginf|isposinf)\(")


def raised_by_finite_assert(exc: str | None, code: tuple[int | None, int], rank: int | None, line_no: int) -> bool:
    """Whether an exception at `line_no` is the AssertionError of the finiteness assert shown at `code`
    (its caret line, 3.11+, may sit between them)."""
    return (exc is not None and exc.rsplit(".", 1)[-1] == "AssertionError" and code[0] == rank
            and 0 < line_no - code[1] <= 2)


def find(seg: Segment, t: str, exc: str | None, exc_form: bool, hits: list[Hit]) -> None:
    """Append this family's hits for one segment (`t` its text, `exc` its short exception class)."""
    # Numeric.
    if not exc_form and t.startswith("assert") and _FINITE_ASSERT_RE.search(t):
        hits.append(Hit("nan_assert_code", Category.NUMERIC, HINT, "nan_detected"))
    elif exc_form and exc and _NUMERIC_CLASS_RE.search(exc) and not _LOSS_SCALE_MIN_RE.search(t):
        hits.append(Hit("nan_detected", Category.NUMERIC, ROOT, "nan_detected", exc=seg.exc))
    elif _LOSS_SCALE_MIN_RE.search(t):
        hits.append(Hit("loss_scale_min", Category.NUMERIC, ROOT, "loss_scale_at_minimum", exc=seg.exc))
    elif _NAN_DETECTED_RE.search(t):
        # Said outside an exception: structural only as the final error of the log (a *_mention).
        hits.append(Hit("nan_detected" if exc_form else "nan_detected_mention", Category.NUMERIC,
                        ROOT if exc_form else HINT, "nan_detected", exc=seg.exc))
    elif ("nan" in t or "inf" in t) and _NAN_LOSS_RE.search(t):
        hits.append(Hit("nan_loss", Category.NUMERIC, HINT, "nan_loss"))

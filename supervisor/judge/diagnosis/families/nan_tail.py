"""The run's last logged metrics are non-finite: one reader for how trainers print a loss or grad norm.

Numeric failures are rarely an exception: the loss goes NaN and the log says so in the trainer's own
print format. Every format below puts a metric's name next to its value, so one reader covers them:
  Python dicts / HF Trainer   {'loss': nan, 'grad_norm': nan}     (transformers trainer.log)
  JSON lines                  {"loss": NaN} / "Infinity" / "nan"  (json.dumps; fairseq json_progress_bar)
  key: value                  loss: nan  loss_cls: nan            (mmengine/mmcv LoggerHook, detectron2
                              total_loss: nan  loss_box_reg: nan   CommonMetricPrinter, Keras progbar
                              - loss: nan - accuracy: 0.1)
  key=value                   loss=nan, v_num=0 / train_loss=nan.0 (tqdm set_postfix, Lightning's bar)
  key value                   | loss nan | / | loss   nan |       (fairseq simple/none progress bar,
                                                                   pytorch/examples)
  logger paths                train/loss nan, loss/train: nan     (tensorboard/wandb scalar tags)
  tensors                     loss: tensor(nan, device='cuda:0')
and one table without names next to values: YOLOv5/ultralytics' per-epoch rows
('%10s' * 2 + '%10.4g' * n) % (f'{epoch}/{epochs - 1}', f'{mem:.3g}G', *mloss, ...), the losses
right after the memory column.

Conditions (the rule's, not any corpus's): the reports are read back from the end of the program's
own tail (printed samples are not in it); the first finite value of the same metric ends the run;
two non-finite reports decide, or one when the loss itself is non-finite (an fp16 overflow step logs a
non-finite grad norm once and is skipped: one grad norm alone is not enough), the latter only when no
other structural cause (an OOM, a device fault, a config error) was found in the log.
"""

from __future__ import annotations

import re

from supervisor.core.models import Category, Phase
from supervisor.judge.diagnosis.hits import ROOT, Hit
from supervisor.judge.diagnosis.wording import Root

# A loss by any name a framework logs it under (decode.loss_seg, loss_cls, noise_step_loss, a logger path
# train/loss or loss/train) or a grad norm, after `=`, `:` or only spaces, its value bare, quoted, or in
# np.float32(...)/tensor(...)/array(...)/[...] (Paddle, TF print arrays), C's printf sign (-nan).
_LOSS_VALUE_RE = re.compile(
    r"""(?:^|[\s{,'"|(/\[])(?P<name>[\w.]*loss\w*(?:/\w+)*|grad_norm|grad norm|gnorm)['"]?(?:\s*[=:]\s*|\s+)['"]?"""
    r"""(?:np\.float\d+\(|tensor\(|array\(|\[\s*)?(?P<v>[-+]?nan(?:\.0)?|[-+]?inf(?:inity)?|[-+]?\d[\d.e+-]*)(?![A-Za-z])""",
    re.IGNORECASE)
# Settings that carry the word but are not a measured loss (DeepSpeed's loss_scale, a loss_weight).
_NOT_A_LOSS_RE = re.compile(r"loss_?(?:scale|scaler|weight|coef|type|fn|func|name|mode)s?\b", re.IGNORECASE)
_MAIN = frozenset(("loss", "total_loss", "train_loss", "grad_norm", "grad norm", "gnorm",
                   "train/loss", "loss/train", "train/total_loss"))
_GRAD = frozenset(("grad_norm", "grad norm", "gnorm"))
# YOLOv5 train.py / ultralytics BaseTrainer: 'epoch/epochs', the memory in G, then the mean losses.
# (A log pasted from a numbered view keeps the view's line number in front: "516   91/300   17G   nan ...")
_YOLO_ROW_RE = re.compile(r"^\s*(?:\d+\s+)?\d+/\d+\s+[\d.]+G\s+(?P<losses>(?:\S+\s+){1,4}?)\d+\s+\d+\b")
# A tensor or array the program printed whose elements are all NaN (torch's and numpy's reprs, at least
# three): the model's outputs or weights have gone non-finite.
_NAN_TENSOR_RE = re.compile(r"(?:tensor\(|array\(|^\s*)\[+\s*nan(?:,?\s+\[*nan\]*){2,}", re.IGNORECASE)
NAN_TAIL_RUN = 2
_NAN_SAID_RE = re.compile(r"[Ll]oss (?:is|became) (?:nan|NaN|inf)\b|Invalid loss, terminating training"
                          # ESPnet-style: "loss (=inf) is not correct", "grad norm is nan. Do not update model."
                          r"|[Ll]oss \(=\s*(?:nan|inf)\)|\bgrad(?:ient)?[ _]norm is (?:nan|inf)\b"
                          # a program's own one-word alarm: "NaN detected", "[NaN/Inf detected] Loss 'x' is invalid"
                          r"|(?<![Nn]o )(?<![Nn]ot )\b(?:NaN|nan|NaN/Inf|nan/inf) detected\b")


def _bad(v: str) -> bool:
    return v.lstrip("+-").startswith(("nan", "inf"))


def _zero(v: str) -> bool:
    try:
        return float(v) == 0.0
    except ValueError:
        return False


def read_metrics(line: str) -> list[tuple[str, str]]:
    """The (name, value) pairs of loss-like metrics a trainer printed on one line, lower-cased."""
    out = [(m.group("name").lower(), m.group("v").lower()) for m in _LOSS_VALUE_RE.finditer(line)
           if not _NOT_A_LOSS_RE.search(m.group("name"))]
    if not out:
        y = _YOLO_ROW_RE.match(line)
        if y:
            out = [("loss", v.lower()) for v in y.group("losses").split()]
    return out


def _scan(tail: list[tuple[int, str]]) -> tuple[list[tuple[int, str]], bool]:
    """The non-finite reports that end the tail (newest first) and whether the newest has a non-finite loss."""
    bad: list[tuple[int, str]] = []
    bad_names: set[str] = set()
    finite_after: set[str] = set()
    loss_bad = False
    for n, raw in reversed(tail):
        if _NAN_SAID_RE.search(raw):  # the program's own "Loss is nan, stopping training"
            loss_bad = loss_bad or not bad
            bad.append((n, raw))
            continue
        vals = read_metrics(raw)
        if not vals and "nan" in raw and _NAN_TENSOR_RE.search(raw):
            loss_bad = loss_bad or not bad
            bad.append((n, raw))
            continue
        main = [(name, v) for name, v in vals if name in _MAIN]
        if not main:
            # A multi-line step logs several losses apart: only the same loss finite on the other side
            # of a NaN one (after: it recovered; before: the run of NaN starts there) ends the run.
            names = {name for name, _ in vals}
            if any(_bad(v) for _, v in vals):
                if names & finite_after:
                    break
                loss_bad = loss_bad or (not bad and any(_bad(v) for name, v in vals if name not in _GRAD))
                bad.append((n, raw))
                bad_names |= names
            elif names & bad_names:
                break
            elif not bad:
                finite_after |= names
            continue
        if any(_bad(v) for _, v in main):
            # a loss of exactly 0 beside a non-finite grad norm is the loss gone too (transformers logs it so)
            # ...and so is any other loss the same line reports non-finite (an RL trainer's pg_loss, kl_loss)
            loss_bad = loss_bad or (not bad and (any(_bad(v) or _zero(v) for name, v in main if name not in _GRAD)
                                                 or any(_bad(v) for name, v in vals if name not in _MAIN)))
            bad.append((n, raw))
        else:
            break
    return bad, loss_bad


def nan_tail_run(tail: list[tuple[int, str]], alone: bool) -> Root | None:
    """The run's last logged losses are NaN/Inf, none finite after the first of them: whatever ended it,
    it had stopped learning. `alone`: no other structural cause was found (a single report may decide)."""
    bad, loss_bad = _scan(tail)
    if len(bad) < NAN_TAIL_RUN and not (bad and loss_bad and alone):
        return None
    last, text = bad[0]
    what = f"the last {len(bad)} logged losses are" if len(bad) > 1 else "the last logged loss is"
    span = f"lines {bad[-1][0]}-{last}" if len(bad) > 1 else f"line {last}"
    return Root(hit=Hit("nan_loss_run", Category.NUMERIC, ROOT, "nan_loss"), line_no=last,
                 text=text.strip()[:2000], rank=None, phase=Phase.TRAIN_STEP,
                 notes=[f"{what} NaN/Inf ({span}), none finite after"])

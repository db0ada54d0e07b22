"""Untrusted text (job names, reasons, quoted training output) made inert for each place it is
shown. A job file and a training log are written by whoever submits; what the daemon sends out
must show their text, never let it act (a script, a tracking image, a disguised link, a ping of a
whole channel). HTML uses `html.escape`; Prometheus label values are escaped by prometheus_client.
"""

from __future__ import annotations

import re

# CommonMark lets any ASCII punctuation be backslash-escaped; these are the ones that open inline
# constructs: emphasis (an underscore only at a word's edge: inside a word it never is), code,
# links and images (no '[' or ']', so '(' and '!' stay plain), strikethrough, table cells, escapes.
# < > & become entities: raw HTML and autolinks need a literal '<'; entities render as the character.
_MD_INLINE = re.compile(r"([\\`*\[\]|~]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")
_MD_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}
_MD_LINE_START = re.compile(r"^(\d*)([-+=.)#])")
_MENTION = re.compile(r"@(?=(here|channel|all|everyone)\b)", re.IGNORECASE)
_ZWSP = "\u200b"


def markdown_text(text: object) -> str:
    """`text` as literal inline Markdown: one line, no markup, no HTML, no links or images."""
    # At the start of a line: a heading, a list item, a setext/thematic line, an ordered list ("1.").
    return _MD_LINE_START.sub(r"\1\\\2", markdown_cell(text))


def markdown_cell(text: object) -> str:
    """`text` inside a table cell (never at the start of a line: "12.5%" and "-" stay as they are)."""
    s = " ".join(str(text).split())  # a newline could start a heading, a list or a code block
    s = "".join(_MD_ENTITIES.get(c, c) for c in s)
    return _MD_INLINE.sub(r"\\\1", s)


def chat_text(text: object) -> str:
    """`text` for a chat webhook's `text`: Slack's mrkdwn escaping (& < >, so `<!channel>` and
    `<http://...|label>` cannot be formed), and for Mattermost and Discord, which render Markdown
    and plain @-mentions, no `@here`/`@channel`/`@all`/`@everyone` and no `[label](url)` link or
    image (a zero-width space breaks each)."""
    s = "".join(_MD_ENTITIES.get(c, c) for c in str(text))
    s = _MENTION.sub("@" + _ZWSP, s)
    return s.replace("](", "]" + _ZWSP + "(")

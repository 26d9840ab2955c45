"""The one place that makes text safe to print, log or write: URLs lose their credentials.

Every writer and printer of a user-given URL (the config error explainer, the mirror, `status`)
routes it through here, so that a secret typed into a URL never reaches a terminal, a log
or a checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import parse_qsl, unquote

# scheme://rest, up to whitespace or a quote: how a URL sits inside a longer message.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")

# Query parameter names that carry a credential (AWS/GCS/Azure signed URLs, tokens, keys).
_SECRET_PARAM = re.compile(r"token|key|secret|sig|signature|password|passwd|pwd|credential|auth"
                           r"|^x-amz-|^x-goog-|^se$|^sp$|^sv$", re.IGNORECASE)

MASK = "***"


def _split_userinfo(rest: str) -> tuple[str, str]:
    """(userinfo, the rest) of what follows `scheme://`; userinfo is '' when there is none."""
    at = rest.find("@")
    if at < 0:
        return "", rest
    # Userinfo may hold an unencoded / or @ (AWS secrets do), so it runs to the last @ before
    # the path; an @ after a plain path segment (hf://org/repo@rev) is a revision, not a user.
    before = rest[:at]
    if "/" in before and ":" not in before:
        return "", rest
    slash = rest.find("/", at)
    end = rest.rfind("@", 0, slash if slash >= 0 else len(rest))
    return rest[:end], rest[end + 1:]


def _strip_one(url: str) -> str:
    """scheme://host/path of one URL: no user, password, query or fragment."""
    scheme, rest = url.split("://", 1)
    rest = _split_userinfo(rest)[1]
    cut = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    return f"{scheme}://{rest[:cut]}"


def redact_url(text: str) -> str:
    """`text` with every URL in it stripped of userinfo, query and fragment.

    Works on a bare URL (`s3://KEY:SECRET@bucket/x?token=t` -> `s3://bucket/x`) and on a longer
    message that quotes one (a storage library's error). Text without a URL comes back unchanged.
    """
    if not isinstance(text, str) or "://" not in text:
        return text
    return _URL.sub(lambda m: _strip_one(m.group(0)), text)


def url_secrets(url: str) -> list[str]:
    """The credential pieces of a URL (user, password, secret query values), raw and decoded,
    longest first, for `scrub` to mask where a library repeats them without the URL around them."""
    if not isinstance(url, str) or "://" not in url:
        return []
    userinfo, rest = _split_userinfo(url.split("://", 1)[1])
    found = userinfo.split(":", 1) if userinfo else []
    query = rest.split("?", 1)[1].split("#", 1)[0] if "?" in rest else ""
    pairs = (pair.partition("=") for pair in query.split("&"))
    found += [value for name, _, value in pairs if _SECRET_PARAM.search(unquote(name))]
    out: set[str] = set()
    for piece in found:
        out |= {form for form in (piece, unquote(piece)) if len(form) >= 3}
    return sorted(out, key=len, reverse=True)


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    """`redact_url(text)`, then every known secret string masked wherever it still appears."""
    text = redact_url(text)
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


def secret_query_params(url: str) -> list[str]:
    """Names of the query parameters of `url` that look like credentials."""
    rest = _split_userinfo(url.split("://", 1)[1])[1] if "://" in url else url
    query = rest.split("?", 1)[1].split("#", 1)[0] if "?" in rest else ""
    return [name for name, _ in parse_qsl(query, keep_blank_values=True) if _SECRET_PARAM.search(name)]


def url_userinfo(url: str) -> str:
    """The `user:password` part of a URL ('' if none)."""
    return _split_userinfo(url.split("://", 1)[1])[0] if "://" in url else ""


def secrets_in(value: object) -> list[str]:
    """`url_secrets` of every URL inside `value`: a string, or the strings (keys included) of
    nested lists, tuples and dicts, as a config or its overrides hold them."""
    found: list[str] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str) and "://" in item:
            found += [piece for match in _URL.finditer(item) for piece in url_secrets(match.group(0))]
        elif isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple)):
            stack += item
    return found

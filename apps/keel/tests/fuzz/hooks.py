"""Schemathesis hooks for the API fuzz run (loaded through SCHEMATHESIS_HOOKS).

An Idempotency-Key means "this operation": a fuzzer that sends the key "0"
with two different orders is told 422 (the key was used for another
request), rightly, and a check that expects valid requests to pass would
call that a failure. So every valid key gets a random suffix
before it is sent; invalid keys, which the server must refuse, go out as
generated.
"""

import re
import uuid

import schemathesis

# The server's grammar, as the OpenAPI document states it.
KEY = re.compile(r'^(?:[!#-~][!-~]{0,254}|"(?:[!#-\[\]-~]|\\["\\]){1,255}")$')


def unique(key: str) -> str:
    suffix = f"~{uuid.uuid4().hex[:12]}"
    if key.startswith('"'):
        inner = key[1:-1]
        fresh = f'"{inner[: max(0, 255 - len(suffix) - 2)]}{suffix}"'
    else:
        fresh = key[: 255 - len(suffix)] + suffix
    return fresh if KEY.fullmatch(fresh) else key


@schemathesis.hook
def before_call(context, case, kwargs):
    headers = case.headers
    key = headers.get("Idempotency-Key") if headers else None
    if isinstance(key, str) and KEY.fullmatch(key):
        headers["Idempotency-Key"] = unique(key)

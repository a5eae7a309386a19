"""The official Anthropic Python SDK against a running Tollgate gateway (`/v1/messages`).

Run by crates/cli/tests/clients/sdk.rs, which starts the simulator and the gateway and passes:
TOLLGATE_BASE_URL, TOLLGATE_KEY (plain), TOLLGATE_RETRY_KEY (2 requests per 2 s),
TOLLGATE_BUDGET_KEY (a 30-token daily budget), TOLLGATE_MODEL. Exits non-zero on the first
failed check.
"""

import os
import time

import anthropic

from checks import attempt_hooks, check

BASE = os.environ["TOLLGATE_BASE_URL"]  # the SDK adds /v1/messages
MODEL = os.environ["TOLLGATE_MODEL"]
MSG = [{"role": "user", "content": "Hello there!"}]


def client(key, attempts):
    # The SDK's own HTTP client class, so that this keeps working whatever it is built on.
    http = anthropic.DefaultHttpxClient(event_hooks=attempt_hooks(attempts))
    return anthropic.Anthropic(base_url=BASE, api_key=key, max_retries=2, http_client=http)


def main():
    # A normal call.
    attempts = []
    c = client(os.environ["TOLLGATE_KEY"], attempts)
    r = c.messages.create(model=MODEL, max_tokens=50, messages=MSG)
    check(r.content[0].text.startswith("tok"), "a normal call answers")
    check(r.usage.output_tokens == 16, f"usage passes through ({r.usage.output_tokens})")

    # A streamed call, through the SDK's stream helper, which reads every event type.
    with c.messages.stream(model=MODEL, max_tokens=5, messages=MSG) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    check(text == " tok" * 5, f"a streamed call streams ({text!r})")
    check(final.usage.output_tokens == 5, f"with its usage ({final.usage.output_tokens})")

    # A 429 for the rate: the SDK waits the advertised time and retries, and then succeeds.
    attempts = []
    c = client(os.environ["TOLLGATE_RETRY_KEY"], attempts)
    c.messages.create(model=MODEL, max_tokens=5, messages=MSG)
    c.messages.create(model=MODEL, max_tokens=5, messages=MSG)
    raw = anthropic.Anthropic(base_url=BASE, api_key=os.environ["TOLLGATE_RETRY_KEY"], max_retries=0)
    try:
        raw.messages.create(model=MODEL, max_tokens=5, messages=MSG)
        check(False, "the third call in the window is refused")
    except anthropic.RateLimitError as e:
        advertised = int(e.response.headers["retry-after-ms"])
        error = e.body["error"]
        check(
            error["type"] == "rate_limit_error" and error["code"] == "request_rate_limit",
            f"429 rate_limit_error (request_rate_limit), retry after {advertised} ms",
        )
    attempts.clear()
    start = time.monotonic()
    r = c.messages.create(model=MODEL, max_tokens=5, messages=MSG)
    waited = time.monotonic() - start
    check(len(attempts) == 2, f"the SDK retried once ({len(attempts)} attempts)")
    gap = attempts[1] - attempts[0]
    check(gap >= 0.9 * advertised / 1000 - 0.2, f"after the advertised delay (waited {gap:.2f} s, advertised {advertised} ms)")
    check(r.content[0].text.startswith("tok"), f"and then succeeded ({waited:.2f} s in all)")

    # A budget exhaustion: 429 with x-should-retry: false, not retried.
    attempts = []
    c = client(os.environ["TOLLGATE_BUDGET_KEY"], attempts)
    c.messages.create(model=MODEL, max_tokens=5, messages=MSG)
    attempts.clear()
    try:
        c.messages.create(model=MODEL, max_tokens=50, messages=MSG)
        check(False, "the budget refuses")
    except anthropic.RateLimitError as e:
        check(e.body["error"]["code"] == "budget_limit", "429 with code budget_limit")
        check(e.response.headers.get("x-should-retry") == "false", "x-should-retry: false")
    check(len(attempts) == 1, f"the SDK did not retry ({len(attempts)} attempts)")
    print("3 passed, 0 failed", flush=True)


if __name__ == "__main__":
    main()

"""The official OpenAI Python SDK against a running Tollgate gateway.

Run by crates/cli/tests/clients/sdk.rs, which starts the simulator and the gateway and passes:
TOLLGATE_BASE_URL, TOLLGATE_KEY (plain), TOLLGATE_RETRY_KEY (2 requests per 2 s),
TOLLGATE_BUDGET_KEY (a 30-token daily budget). Exits non-zero on the first failed check.
"""

import os
import time

import openai

from checks import attempt_hooks, check

BASE = os.environ["TOLLGATE_BASE_URL"] + "/v1"
MSG = [{"role": "user", "content": "Hello there!"}]


def client(key, attempts):
    # The SDK's own HTTP client class, so that this keeps working whatever it is built on.
    http = openai.DefaultHttpxClient(event_hooks=attempt_hooks(attempts))
    return openai.OpenAI(base_url=BASE, api_key=key, max_retries=2, http_client=http)


def main():
    # A normal call.
    attempts = []
    c = client(os.environ["TOLLGATE_KEY"], attempts)
    r = c.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=50)
    check(r.choices[0].message.content.startswith("tok"), "a normal call answers")
    check(r.usage.completion_tokens == 16, f"usage passes through ({r.usage.completion_tokens})")

    # A streamed call: the chunks arrive, the usage chunk the gateway asked for does not.
    chunks = list(c.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=5, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    check(text == " tok" * 5, f"a streamed call streams ({text!r})")
    check(all(ch.usage is None for ch in chunks), "no usage chunk unless asked for")
    chunks = list(
        c.chat.completions.create(
            model="gpt-4o", messages=MSG, max_tokens=5, stream=True, stream_options={"include_usage": True}
        )
    )
    check(chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5, "usage chunk when asked for")

    # A 429 for the rate: the SDK waits the advertised time and retries, and then succeeds.
    attempts = []
    c = client(os.environ["TOLLGATE_RETRY_KEY"], attempts)
    c.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=5)
    c.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=5)
    raw = openai.OpenAI(base_url=BASE, api_key=os.environ["TOLLGATE_RETRY_KEY"], max_retries=0)
    try:
        raw.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=5)
        check(False, "the third call in the window is refused")
    except openai.RateLimitError as e:
        advertised = int(e.response.headers["retry-after-ms"])
        check(e.code == "request_rate_limit", f"429 with code request_rate_limit, retry after {advertised} ms")
    attempts.clear()
    start = time.monotonic()
    r = c.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=5)
    waited = time.monotonic() - start
    check(len(attempts) == 2, f"the SDK retried once ({len(attempts)} attempts)")
    gap = attempts[1] - attempts[0]
    check(gap >= 0.9 * advertised / 1000 - 0.2, f"after the advertised delay (waited {gap:.2f} s, advertised {advertised} ms)")
    check(r.choices[0].message.content.startswith("tok"), f"and then succeeded ({waited:.2f} s in all)")

    # A budget exhaustion: 429 with x-should-retry: false, not retried.
    attempts = []
    c = client(os.environ["TOLLGATE_BUDGET_KEY"], attempts)
    c.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=5)
    attempts.clear()
    try:
        c.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=50)
        check(False, "the budget refuses")
    except openai.RateLimitError as e:
        check(e.code == "budget_limit", "429 with code budget_limit")
        check(e.response.headers.get("x-should-retry") == "false", "x-should-retry: false")
    check(len(attempts) == 1, f"the SDK did not retry ({len(attempts)} attempts)")
    print("3 passed, 0 failed", flush=True)


if __name__ == "__main__":
    main()

"""The official OpenAI Python SDK's Responses API (`client.responses`) against a running Tollgate
gateway.

Run by crates/cli/tests/clients/sdk.rs, which starts the simulator and the gateway and passes:
TOLLGATE_BASE_URL, TOLLGATE_KEY (plain), TOLLGATE_RETRY_KEY (2 requests per 2 s),
TOLLGATE_BUDGET_KEY (a 30-token daily budget). Exits non-zero on the first failed check.
"""

import os

import openai

from checks import attempt_hooks, check

BASE = os.environ["TOLLGATE_BASE_URL"] + "/v1"


def client(key, attempts):
    http = openai.DefaultHttpxClient(event_hooks=attempt_hooks(attempts))
    return openai.OpenAI(base_url=BASE, api_key=key, max_retries=2, http_client=http)


def main():
    # A call, and a follow-up that the upstream bills for the whole conversation.
    c = client(os.environ["TOLLGATE_KEY"], [])
    r = c.responses.create(model="gpt-4o", input="Hello there!", max_output_tokens=50)
    check(r.output_text.startswith("tok"), f"a call answers ({r.output_text[:12]!r})")
    check(r.usage.output_tokens == 16, f"usage passes through ({r.usage.output_tokens})")
    r2 = c.responses.create(model="gpt-4o", input="And again?", previous_response_id=r.id, max_output_tokens=50)
    carried = r.usage.input_tokens + r.usage.output_tokens
    check(r2.usage.input_tokens > carried, f"a follow-up is served ({r2.usage.input_tokens} input tokens)")

    # Streamed, through the SDK's stream helper: the typed events arrive and make the response.
    with c.responses.stream(model="gpt-4o", input="Hello there!", max_output_tokens=20) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    check("".join(deltas) == " tok" * 16, f"a stream streams ({len(deltas)} deltas)")
    check(final.status == "completed" and final.usage.output_tokens == 16, "and ends with its usage")

    # A 429 for the rate, retried by the SDK after the advertised delay.
    attempts = []
    c = client(os.environ["TOLLGATE_RETRY_KEY"], attempts)
    c.responses.create(model="gpt-4o", input="Hi", max_output_tokens=16)
    c.responses.create(model="gpt-4o", input="Hi", max_output_tokens=16)
    attempts.clear()
    r = c.responses.create(model="gpt-4o", input="Hi", max_output_tokens=16)
    check(len(attempts) == 2 and r.output_text.startswith("tok"), f"a 429 is retried, then served ({len(attempts)} attempts)")

    # The budget (30 tokens a day): a first turn fits; its follow-up, whose body is as small,
    # carries the first turn's input and output and does not fit: 429, not retried.
    attempts = []
    c = client(os.environ["TOLLGATE_BUDGET_KEY"], attempts)
    r = c.responses.create(model="gpt-4o", input="Hi", max_output_tokens=5)
    spent = r.usage.input_tokens + r.usage.output_tokens
    attempts.clear()
    try:
        c.responses.create(model="gpt-4o", input="Hi", previous_response_id=r.id, max_output_tokens=5)
        check(False, f"the follow-up is refused ({spent} of 30 tokens spent)")
    except openai.RateLimitError as e:
        check(e.code == "budget_limit", f"the follow-up is refused for the budget ({spent} of 30 tokens spent)")
        check(e.response.headers.get("x-should-retry") == "false", "x-should-retry: false")
    check(len(attempts) == 1, f"the SDK did not retry ({len(attempts)} attempts)")
    print("3 passed, 0 failed", flush=True)


if __name__ == "__main__":
    main()

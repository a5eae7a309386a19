"""The official OpenAI Python SDK retrying one request that carries an Idempotency-Key.

Run by crates/cli/tests/clients/sdk.rs against a gateway whose upstream takes one second to answer.
The client gives up on each attempt after 0.3 s and retries: its first attempt goes on in the
gateway and is answered; the retries while it runs get 409 (and retry), the one after gets
the kept response. TOLLGATE_BUDGET_KEY's tenant has a 30-token daily budget: one such call
reserves more than half of it, so it could never have been admitted twice, and a later call
finds what one call left. Exits non-zero on the first failed check.
"""

import os

import openai

from checks import attempt_hooks, check

BASE = os.environ["TOLLGATE_BASE_URL"] + "/v1"
MSG = [{"role": "user", "content": "Hello there!"}]


def main():
    attempts = []
    http = openai.DefaultHttpxClient(event_hooks=attempt_hooks(attempts))
    c = openai.OpenAI(
        base_url=BASE, api_key=os.environ["TOLLGATE_BUDGET_KEY"], max_retries=6, timeout=0.3, http_client=http
    )
    raw = c.chat.completions.with_raw_response.create(
        model="gpt-4o", messages=MSG, max_tokens=12, extra_headers={"Idempotency-Key": "order-42"}
    )
    r = raw.parse()
    check(r.choices[0].message.content.startswith("tok"), f"the retried call answers ({len(attempts)} attempts)")
    check(len(attempts) >= 2, "the client timed out and retried")
    check(raw.headers.get("x-tollgate-idempotent-replay") == "true", "the answer is the first attempt's, kept")

    # The same key again, later: the kept answer, not a new request.
    again = c.chat.completions.with_raw_response.create(
        model="gpt-4o", messages=MSG, max_tokens=12, extra_headers={"Idempotency-Key": "order-42"}
    )
    check(again.parse().id == r.id, "a later use of the key gets the same answer")

    # The same key with another body: 422, not retried.
    attempts.clear()
    try:
        c.chat.completions.create(
            model="gpt-4o", messages=MSG, max_tokens=11, extra_headers={"Idempotency-Key": "order-42"}
        )
        check(False, "another body under the key is refused")
    except openai.UnprocessableEntityError as e:
        check(e.code == "idempotency_key_reused", "422 idempotency_key_reused")
    check(len(attempts) == 1, f"and not retried ({len(attempts)} attempts)")

    # Charged once: what is left of the budget is what one call left.
    try:
        openai.OpenAI(base_url=BASE, api_key=os.environ["TOLLGATE_BUDGET_KEY"], max_retries=0).chat.completions.create(
            model="gpt-4o", messages=MSG, max_tokens=1
        )
        check(False, "the budget has less left than a call's reservation")
    except openai.RateLimitError as e:
        check(e.code == "budget_limit", "the rest of the budget is what one call left")
    print("7 passed, 0 failed", flush=True)


if __name__ == "__main__":
    main()

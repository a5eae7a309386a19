"""The official OpenAI and Anthropic Python SDKs read a stream the gateway ends at its cap.

Run by crates/cli/tests/clients/sdk.rs against a simulated model that runs past any cap it is given:
the gateway ends each stream as the provider would have at the cap, and each SDK finishes the
answer normally, as one cut by its cap. Exits non-zero on the first failed check.
"""

import os

import anthropic
import openai

from checks import check

BASE = os.environ["TOLLGATE_BASE_URL"]
KEY = os.environ["TOLLGATE_KEY"]
MODEL = os.environ["TOLLGATE_MODEL"]
MSG = [{"role": "user", "content": "Go on forever."}]
CAP = 40
# The cap, its tolerance (at least 16 tokens) and the event that passed them.
MOST = CAP + 16 + 1


def main():
    oa = openai.OpenAI(base_url=BASE + "/v1", api_key=KEY, max_retries=0)
    chunks = list(
        oa.chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=CAP, stream=True, stream_options={"include_usage": True}
        )
    )
    deltas = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    check(CAP < len(deltas) <= MOST, f"chat: the stream ends near its cap ({len(deltas)} tokens)")
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    check(finishes == ["length"], f"chat: finish_reason length ({finishes})")
    check(chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(deltas), "chat: its usage")

    events = list(oa.responses.create(model=MODEL, input="Go on forever.", max_output_tokens=CAP, stream=True))
    text = [e for e in events if e.type == "response.output_text.delta"]
    check(CAP < len(text) <= MOST, f"responses: the stream ends near its cap ({len(text)} deltas)")
    last = events[-1]
    check(last.type == "response.incomplete", f"responses: it ends incomplete ({last.type})")
    check(last.response.incomplete_details.reason == "max_output_tokens", "responses: for max_output_tokens")

    an = anthropic.Anthropic(base_url=BASE, api_key=KEY, max_retries=0)
    with an.messages.stream(model=MODEL, max_tokens=CAP, messages=MSG) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    check(final.stop_reason == "max_tokens", f"anthropic: stop_reason max_tokens ({final.stop_reason})")
    check(final.content[0].text == streamed, "anthropic: the SDK's message holds what streamed")
    check(CAP < final.usage.output_tokens <= MOST, f"anthropic: its usage ({final.usage.output_tokens})")
    print("3 passed, 0 failed", flush=True)


if __name__ == "__main__":
    main()

"""What the SDK end-to-end scripts share: a check that stops at the first failure, and an
httpx event hook that records when each attempt (retries included) was sent."""

import sys
import time


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}", flush=True)
        sys.exit(1)
    print(f"ok: {what}", flush=True)


def attempt_hooks(attempts):
    """Event hooks for an SDK's httpx client that append each attempt's time to `attempts`."""

    def count(request):
        attempts.append(time.monotonic())

    return {"request": [count]}

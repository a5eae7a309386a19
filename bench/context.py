"""Agent-scale prompts through the gateway, against the upstream simulator called directly in the
same run: what the gateway adds to a request of about 1k, 10k and 100k input tokens, to each turn
of an agent loop whose history grows to about 100k tokens, and to small streamed turns' time to
first byte while other clients send 100k-token requests. Used by bench/context.sh.

    python3 bench/context.py GATEWAY_PORT SIM_PORT [REPEATS]
"""

import http.client
import json
import multiprocessing
import random
import statistics
import sys
import time

GATEWAY, SIM = int(sys.argv[1]), int(sys.argv[2])
REPEATS = int(sys.argv[3]) if len(sys.argv) > 3 else 15
LOOPS = 3
HEADERS = {"content-type": "application/json", "authorization": "Bearer sk-bench"}
WORDS = (
    "the of and to in is that for it as with was on be at by this had not are but from or have "
    "an they which one you were her all she there would their we him been has when who will more "
    "no if out so said what up its about into than them can only other new some could time these "
    "two may then do first any my now such like our over man me even most made after also did many "
    "before must through back years where much your way well down should because each just those "
    "fn let mut impl struct enum match return self async await result option vec string usize u64 "
    "error config request response token budget limit scope tenant lease reserve settle window"
).split()


def text(rng, tokens):
    """About `tokens` tokens of prose and code-like words (about 1.1 tokens a word)."""
    out, n = [], 0
    while n < tokens:
        line = " ".join(rng.choice(WORDS) for _ in range(12))
        if rng.random() < 0.2:
            line = "    " + line.replace(" ", "_", 3) + "();"
        out.append(line)
        n += 14
    return "\n".join(out)


def body(messages, stream=False):
    return json.dumps(
        {"model": "gpt-4o", "max_tokens": 16, "stream": stream, "messages": messages}
    ).encode()


class Client:
    def __init__(self, port):
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def post(self, data, first_byte=False):
        """Seconds until the whole answer (or its first body byte) arrived."""
        t0 = time.perf_counter()
        self.conn.request("POST", "/v1/chat/completions", body=data, headers=HEADERS)
        r = self.conn.getresponse()
        if r.status != 200:
            raise SystemExit(f"port {self.port}: {r.status} {r.read()[:300]!r}")
        if first_byte:
            r.read(1)
            t = time.perf_counter() - t0
            r.read()
            return t
        r.read()
        return time.perf_counter() - t0


def added(gw, sim, bodies):
    """Median time added by the gateway: each body sent to both, in turns."""
    g, d = [], []
    for b in bodies:
        d.append(sim.post(b))
        g.append(gw.post(b))
    return statistics.median(g) - statistics.median(d), statistics.median(d)


def flood(seed):
    """Sends fresh ~100k-token prompts without pause: one text, rotated at another line each
    time, so that no text was counted before."""
    c, r = Client(GATEWAY), random.Random(seed)
    base = text(r, 100_000)
    cuts = [i for i, ch in enumerate(base) if ch == "\n"]
    i = 0
    while True:
        k = cuts[(i * 7919) % len(cuts)]
        content = f"{seed}-{i}\n" + base[k + 1 :] + "\n" + base[:k]
        c.post(body([{"role": "user", "content": content}]))
        i += 1


def main():
    rng = random.Random(7)
    gw, sim = Client(GATEWAY), Client(SIM)
    rows = []
    # Warm both (connections, the vocabularies) on a body no measurement repeats.
    for _ in range(3):
        added(gw, sim, [body([{"role": "user", "content": text(rng, 500)}])])
    for size in (1_000, 10_000, 100_000):
        # A fresh prompt every time: nothing counted before can be reused.
        bodies = [body([{"role": "user", "content": text(rng, size)}]) for _ in range(REPEATS)]
        a, base = added(gw, sim, bodies)
        rows.append((f"~{size // 1000}k tokens, fresh", a, base))
    # The agent loop: every turn sends the whole history again, one turn (~2.5k tokens) longer.
    # Three loops, the last 10 turns of each pooled.
    last = []
    for _ in range(LOOPS):
        history, turns = [{"role": "system", "content": text(rng, 1_000)}], []
        while len(json.dumps(history)) < 400_000:
            history.append({"role": "user", "content": text(rng, 1_250)})
            b = body(history)
            d = sim.post(b)
            g = gw.post(b)
            turns.append((g - d, d))
            history.append({"role": "assistant", "content": text(rng, 1_250)})
        last += turns[-10:]
    rows.append(
        (
            f"each turn of an agent loop, the last 10 of {len(turns)} in {LOOPS} loops (~90-100k tokens)",
            statistics.median(t[0] for t in last),
            statistics.median(t[1] for t in last),
        )
    )
    for name, a, base in rows:
        print(f"| {name} | {a * 1000:.2f} ms | {base * 1000:.2f} ms |")
    # Head of line: small streamed turns' time to first byte, alone and while two clients send
    # fresh ~100k-token requests without pause.
    small = body([{"role": "user", "content": "Say hello in three words."}], stream=True)
    probe = Client(GATEWAY)

    def ttfb(n):
        return sorted(probe.post(small, first_byte=True) for _ in range(n))

    def p99(xs):
        return xs[min(len(xs) - 1, int(len(xs) * 0.99))]

    alone = ttfb(300)
    # The flooding clients are processes of their own, so that this one's timing is not theirs.
    floods = [multiprocessing.Process(target=flood, args=(s,), daemon=True) for s in (11, 12)]
    for f in floods:
        f.start()
    time.sleep(1.0)
    loaded = ttfb(300)
    for f in floods:
        f.terminate()
        f.join(timeout=10)
    print(
        f"| small streamed turn, p99 time to first byte: alone {p99(alone) * 1000:.2f} ms, "
        f"while two clients send ~100k-token requests {p99(loaded) * 1000:.2f} ms | "
        f"{p99(loaded) / p99(alone):.1f}x | |"
    )


if __name__ == "__main__":
    main()

/**
 * Budgets for code that calls an LLM provider itself (an edge function with its own provider
 * key): reserve with a Tollgate gateway before the call, send the body it gives back, settle
 * with the provider's usage after. The gateway checks and holds the budget in one atomic step
 * in the store its instances share, so stateless callers never overspend together.
 *
 * Web `fetch` only: Node 18+, Vercel Edge, Cloudflare Workers, Deno, browsers.
 */

/** The API paths a reservation may be for. */
export type Endpoint =
  | "/v1/chat/completions"
  | "/v1/responses"
  | "/v1/messages"
  | "/v1/completions"
  | "/v1/embeddings";

export interface TollgateOptions {
  /** The gateway's address, e.g. `https://tollgate.internal`. */
  baseUrl: string;
  /** A key whose `uses` allows reservations. */
  apiKey: string;
  /** A `fetch` of your own (tests, instrumentation); the global one by default. */
  fetch?: typeof fetch;
  /** Headers the API acts on (e.g. `anthropic-beta`), sent with each reservation. */
  headers?: Record<string, string>;
}

/** A granted reservation. */
export interface Reservation<B = Record<string, unknown> | null> {
  id: string;
  object: "reservation";
  endpoint: Endpoint;
  model: string;
  input_tokens: number;
  /** The output cap granted, written into `body`. */
  max_output_tokens: number;
  /** The body field that carries the cap. */
  cap_field: string;
  reserved_tokens: number;
  /** When the lease ends unless renewed (RFC 3339, the store's clock). */
  expires_at: string;
  expires_at_ms: number;
  /** The model a degrade rule switched from, if one did (then `body` names the new one). */
  degraded_from: string | null;
  /** The body to send to the provider, unchanged. */
  body: B;
}

/** The answer to a settlement or a release. */
export interface Ending {
  id: string;
  object: "reservation";
  status: "settled" | "released" | "already_settled" | "already_released";
  usage: { input_tokens: number; cached_input_tokens: number; output_tokens: number };
  /** Usage above the reservation: charged in full. */
  over_reservation: boolean;
}

/** A refusal or an error from the gateway, in its API's error format. */
export class TollgateError extends Error {
  /** The HTTP status: 429 for a limit, 400 for a request it cannot price, 503 when switched off. */
  readonly status: number;
  /** The gateway's error code, e.g. `budget_limit`, `kill_switch`, `usage_missing`. */
  readonly code: string;
  /** Seconds to wait before a retry, when the gateway says (`Retry-After`). */
  readonly retryAfter: number | null;
  /** Whether a retry may succeed (`x-should-retry`). */
  readonly shouldRetry: boolean | null;
  readonly param: string | null;

  constructor(status: number, body: unknown, headers: Headers) {
    const err = (body as { error?: Record<string, unknown> } | null)?.error ?? {};
    const message = typeof err.message === "string" ? err.message : `HTTP ${status}`;
    super(message);
    this.name = "TollgateError";
    this.status = status;
    this.code = typeof err.code === "string" ? err.code : `http_${status}`;
    this.param = typeof err.param === "string" ? err.param : null;
    const retry = headers.get("retry-after");
    this.retryAfter = retry !== null && /^\d+$/.test(retry) ? Number(retry) : null;
    const should = headers.get("x-should-retry");
    this.shouldRetry = should === null ? null : should === "true";
  }
}

/** Usage as a provider reports it: OpenAI's (chat or Responses) or Anthropic's. */
export type Usage = Record<string, unknown>;

/** What an SDK call may return: a whole response, or a stream of chunks or events. */
type Answer = { usage?: Usage | null } | AsyncIterable<unknown>;

export class Tollgate {
  readonly #base: string;
  readonly #key: string;
  readonly #fetch: typeof fetch;
  readonly #headers: Record<string, string>;

  constructor(options: TollgateOptions) {
    if (!options.baseUrl) throw new TypeError("baseUrl is required");
    if (!options.apiKey) throw new TypeError("apiKey is required");
    this.#base = options.baseUrl.replace(/\/+$/, "");
    this.#key = options.apiKey;
    this.#fetch = options.fetch ?? globalThis.fetch.bind(globalThis);
    this.#headers = options.headers ?? {};
  }

  async #call<T>(method: string, path: string, body?: unknown, signal?: AbortSignal): Promise<T> {
    const init: RequestInit = {
      method,
      headers: {
        ...this.#headers,
        authorization: `Bearer ${this.#key}`,
        "content-type": "application/json",
      },
      body: body === undefined ? undefined : JSON.stringify(body),
    };
    if (signal) init.signal = signal;
    const r = await this.#fetch(`${this.#base}${path}`, init);
    const text = await r.text();
    let json: unknown = null;
    try {
      json = text ? JSON.parse(text) : null;
    } catch {
      json = null;
    }
    if (!r.ok) throw new TollgateError(r.status, json, r.headers);
    return json as T;
  }

  /** Reserves for `body`, the request the caller will send to `endpoint`. */
  reserve<B extends Record<string, unknown>>(
    endpoint: Endpoint,
    body: B,
    options: { signal?: AbortSignal } = {},
  ): Promise<Reservation<B>> {
    return this.#call("POST", "/v1/reservations", { endpoint, body }, options.signal);
  }

  /**
   * Reserves for a request stated by its counts, when its body cannot be sent: the gateway
   * checks them as it would a body's, and the answer's `body` is `null` (send
   * `max_output_tokens` as the cap).
   */
  reserveCounts(
    endpoint: Endpoint,
    counts: { model: string; input_tokens: number; max_output_tokens: number },
    options: { signal?: AbortSignal } = {},
  ): Promise<Reservation<null>> {
    return this.#call("POST", "/v1/reservations", { endpoint, ...counts }, options.signal);
  }

  /**
   * Settles with what the provider reported: its usage object, its final response, or the
   * stream chunk or event that carries usage. Idempotent.
   */
  settle(id: string, reported: unknown): Promise<Ending> {
    return this.#call("POST", `/v1/reservations/${encodeURIComponent(id)}/settle`, reported);
  }

  /** The lease lives one lifetime more. */
  renew(id: string): Promise<{ id: string; expires_at: string; expires_at_ms: number }> {
    return this.#call("POST", `/v1/reservations/${encodeURIComponent(id)}/renew`);
  }

  /** Ends a reservation whose call was not made: nothing is charged. */
  release(id: string): Promise<Ending> {
    return this.#call("DELETE", `/v1/reservations/${encodeURIComponent(id)}`);
  }

  /**
   * Reserves for `body`, runs `call` with the body to send, and settles from its usage.
   *
   * - A whole response is settled when it returns.
   * - A stream (any async iterable of chunks or events, as the OpenAI and Anthropic SDKs
   *   return) is passed through and settled from the usage it carried once it has been read
   *   to its end.
   * - A throw before an answer, or an abort of `signal` before one, releases the reservation
   *   (nothing was billed).
   * - A stream that breaks off before its usage is left to the gateway: the lease ends and the
   *   whole reservation is charged, as the provider may have billed all of it.
   */
  async withBudget<B extends Record<string, unknown>, R extends Answer>(
    endpoint: Endpoint,
    body: B,
    call: (body: B, reservation: Reservation<B>) => Promise<R>,
    options: { signal?: AbortSignal } = {},
  ): Promise<R> {
    const reservation = await this.reserve(endpoint, body, options);
    let answer: R;
    try {
      options.signal?.throwIfAborted();
      answer = await call(reservation.body, reservation);
    } catch (e) {
      await this.release(reservation.id).catch(() => undefined);
      throw e;
    }
    if (isAsyncIterable(answer)) {
      return this.#metered(reservation.id, answer) as R;
    }
    const usage = (answer as { usage?: Usage | null }).usage;
    if (usage) {
      await this.settle(reservation.id, answer);
    } else {
      // No usage to settle with: the lease ends and the reservation is charged.
      throw new TollgateError(
        400,
        { error: { code: "usage_missing", message: "the provider's answer carried no usage" } },
        new Headers(),
      );
    }
    return answer;
  }

  /** `stream` passed through, its usage gathered, settled at its end. */
  #metered<S extends AsyncIterable<unknown>>(id: string, stream: S): S {
    const client = this;
    const usage = new UsageOf();
    const wrapped = {
      async *[Symbol.asyncIterator]() {
        for await (const item of stream) {
          usage.see(item);
          yield item;
        }
        const seen = usage.total();
        if (seen) await client.settle(id, { usage: seen });
      },
    };
    // The SDK's own stream methods (`controller`, `toReadableStream`) stay reachable.
    return Object.assign(Object.create(Object.getPrototypeOf(stream) ?? null), stream, wrapped);
  }
}

function isAsyncIterable(v: unknown): v is AsyncIterable<unknown> {
  return v !== null && typeof v === "object" && Symbol.asyncIterator in (v as object);
}

/**
 * The usage a stream carries: OpenAI's last chunk (`usage`), or Anthropic's `message_start`
 * (the message's usage) updated by its `message_delta` events (cumulative counts).
 */
class UsageOf {
  #usage: Usage | null = null;

  see(item: unknown): void {
    if (item === null || typeof item !== "object") return;
    const o = item as Record<string, unknown>;
    const message = o.message as Record<string, unknown> | undefined;
    if (o.type === "message_start" && message && isObject(message.usage)) {
      this.#usage = { ...(message.usage as Usage) };
    } else if (isObject(o.usage)) {
      this.#usage = { ...(this.#usage ?? {}), ...stripNulls(o.usage as Usage) };
    } else if (o.type === "response.completed" && isObject(o.response)) {
      const u = (o.response as Record<string, unknown>).usage;
      if (isObject(u)) this.#usage = { ...(u as Usage) };
    }
  }

  total(): Usage | null {
    return this.#usage;
  }
}

function isObject(v: unknown): boolean {
  return v !== null && typeof v === "object" && !Array.isArray(v);
}

function stripNulls(u: Usage): Usage {
  return Object.fromEntries(Object.entries(u).filter(([, v]) => v !== null));
}

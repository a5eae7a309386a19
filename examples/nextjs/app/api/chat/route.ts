// A Next.js route on the Edge runtime that calls OpenAI with its own key, within the budgets a
// Tollgate gateway keeps for every instance: reserve, call, settle, in one `withBudget`.
import OpenAI from "openai";
import { Tollgate, TollgateError } from "tollgate-client";

export const runtime = "edge";

const tollgate = new Tollgate({
  baseUrl: process.env.TOLLGATE_URL!,
  apiKey: process.env.TOLLGATE_KEY!, // a key with uses = "reservations"
});
const openai = new OpenAI();

export async function POST(req: Request): Promise<Response> {
  const { messages } = await req.json();
  try {
    const stream = await tollgate.withBudget(
      "/v1/chat/completions",
      { model: "gpt-4o-mini", max_tokens: 400, stream: true, messages },
      (body) => openai.chat.completions.create(body),
      { signal: req.signal },
    );
    const encoder = new TextEncoder();
    return new Response(
      new ReadableStream({
        async start(controller) {
          // Read to the end: the reservation is settled from the stream's usage.
          for await (const chunk of stream) {
            controller.enqueue(encoder.encode(chunk.choices[0]?.delta?.content ?? ""));
          }
          controller.close();
        },
      }),
      { headers: { "content-type": "text/plain; charset=utf-8" } },
    );
  } catch (e) {
    if (e instanceof TollgateError) {
      const headers = e.retryAfter === null ? undefined : { "retry-after": String(e.retryAfter) };
      return Response.json({ error: e.code, message: e.message }, { status: e.status, headers });
    }
    throw e;
  }
}

// Next.js middleware: refuses at the edge, before the route runs, a caller whose budget is
// spent. It reads what is left at GET /v1/limits, which counts in no rate. The route's
// reservation still decides; this only spares the route's work when nothing is left.
import { NextResponse, type NextRequest } from "next/server";

export const config = { matcher: "/api/chat" };

export async function middleware(_req: NextRequest): Promise<NextResponse> {
  const r = await fetch(`${process.env.TOLLGATE_URL}/v1/limits`, {
    headers: { authorization: `Bearer ${process.env.TOLLGATE_KEY}` },
  });
  if (r.ok) {
    const { limits } = (await r.json()) as {
      limits: { control: string; remaining?: number; resets_at?: string }[];
    };
    const spent = limits.find((l) => l.control === "budget" && l.remaining === 0);
    if (spent) {
      return NextResponse.json(
        { error: "budget_limit", message: `The budget is spent until ${spent.resets_at}.` },
        { status: 429 },
      );
    }
  }
  return NextResponse.next();
}

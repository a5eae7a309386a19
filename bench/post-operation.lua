-- wrk: bench/post.lua's chat completion, naming an agent operation.
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
wrk.headers["authorization"] = "Bearer sk-bench"
wrk.headers["x-tollgate-operation"] = "bench-run"
wrk.body = '{"model":"gpt-4o","max_tokens":16,"messages":[{"role":"user","content":"Say hello in three words."}]}'

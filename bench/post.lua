-- wrk: a small chat completion with a virtual key.
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
wrk.headers["authorization"] = "Bearer sk-bench"
wrk.body = '{"model":"gpt-4o","max_tokens":16,"messages":[{"role":"user","content":"Say hello in three words."}]}'

// One cell of the clients matrix with an official JavaScript SDK (tests/test_js_clients.py).
//
//   node cell.mjs SDK CELL BASE_URL CHAT_MODEL EMBED_MODEL [KEY]
//
// SDK: openai | ollama | anthropic. CELL: chat, stream-usage, abort, structured, tools,
// embeddings, errors, retry-429. Prints one JSON line with what it saw (the test asserts
// on it and on the hub's audit line); any failure throws, and node exits 1 with the stack.
import Anthropic from "@anthropic-ai/sdk";
import { Ollama } from "ollama";
import OpenAI from "openai";

const [sdk, cell, base, chat, embed, key = "anyone"] = process.argv.slice(2);
const USER = [{ role: "user", content: "what is the weather in Paris?" }];
const SCHEMA = {
  type: "object",
  properties: { name: { type: "string" }, age: { type: "integer" } },
  required: ["name", "age"],
};
const PARAMS = { type: "object", properties: { city: { type: "string" } }, required: ["city"] };
const WEATHER = { type: "function", function: { name: "weather", description: "the weather in a city", parameters: PARAMS } };
const READ = 20; // pieces an aborting client reads first

// Every status the SDK saw, to tell a retried 429 from a first success.
const statuses = [];
let saw429;
const first429 = new Promise((r) => { saw429 = r; });
async function countingFetch(url, init) {
  const r = await fetch(url, init);
  statuses.push(r.status);
  if (r.status === 429) saw429();
  return r;
}

function check(cond, what) {
  if (!cond) throw new Error(`check failed: ${what}`);
}

function out(obj) {
  console.log(JSON.stringify({ ok: true, sdk, cell, statuses, ...obj }));
}

// A request that holds the key's one place (MaxConcurrent=1) while it streams.
// The 429 cells, on a key of one place, without a race against the machine's speed: a
// long stream holds the place (its headers are in: the hub granted it), a second request
// is sent, and only once that one has been refused does the holder let go (`release`).
// A holder that ended before the second arrived (a fast engine) is tried again.
async function whileHeld(hold, release, second) {
  for (let tries = 0; tries < 5; tries++) {
    const held = await hold();
    const answer = second().then((r) => ({ r }), (e) => ({ e }));
    const first = await Promise.race([first429.then(() => "429"), answer.then(() => "answered")]);
    release(held);
    const got = await answer;
    if (first === "429") return got;
    if (got.e) throw got.e;
  }
  throw new Error("the holder ended before a second request came, 5 times");
}

async function openaiCell() {
  const retries = cell === "retry-429" ? 6 : 0;
  const c = new OpenAI({ baseURL: `${base}/v1`, apiKey: key, maxRetries: retries, timeout: 120000, fetch: countingFetch });
  switch (cell) {
    case "chat": {
      const r = await c.chat.completions.create({ model: chat, messages: USER, max_tokens: 8 });
      check(typeof r.choices[0].message.content === "string", "content is text");
      check(r.usage.completion_tokens > 0, "usage counted");
      return out({ text: r.choices[0].message.content });
    }
    case "stream-usage": {
      const s = await c.chat.completions.create({ model: chat, messages: USER, max_tokens: 8, stream: true, stream_options: { include_usage: true } });
      let text = "", usage = null;
      for await (const ch of s) {
        if (ch.choices.length) text += ch.choices[0].delta.content ?? "";
        if (ch.usage) usage = ch.usage;
      }
      check(usage && usage.completion_tokens > 0, "the last chunk carries the usage");
      return out({ text, usage });
    }
    case "abort": {
      const s = await c.chat.completions.create({ model: chat, messages: USER, max_tokens: 400, stream: true });
      let n = 0;
      for await (const ch of s) {
        if (ch.choices.length && ch.choices[0].delta.content) n += 1;
        if (n >= READ) { s.controller.abort(); break; }
      }
      check(n === READ, `read ${READ} pieces before aborting (got ${n})`);
      return out({ pieces: n });
    }
    case "structured": {
      const r = await c.chat.completions.create({ model: chat, max_tokens: 64,
        messages: [{ role: "user", content: "Ann is 31. Give her name and age as JSON." }],
        response_format: { type: "json_schema", json_schema: { name: "person", schema: SCHEMA } } });
      const v = JSON.parse(r.choices[0].message.content);
      check(typeof v.name === "string" && Number.isInteger(v.age), "JSON of the schema");
      return out({ value: v });
    }
    case "tools": {
      const first = await c.chat.completions.create({ model: chat, messages: USER, max_tokens: 64, tools: [WEATHER], tool_choice: "required" });
      const call = first.choices[0].message.tool_calls?.[0];
      check(call && call.function.name === "weather", "a call of the tool");
      const args = JSON.parse(call.function.arguments);
      const second = await c.chat.completions.create({ model: chat, max_tokens: 16, tools: [WEATHER], messages: [
        ...USER, first.choices[0].message,
        { role: "tool", tool_call_id: call.id, content: "sunny, 21 C" }] });
      check(typeof second.choices[0].message.content === "string", "an answer after the tool's result");
      return out({ args, answer: second.choices[0].message.content });
    }
    case "embeddings": {
      const r = await c.embeddings.create({ model: embed, input: ["hello", "world"] });
      check(r.data.length === 2 && r.data[0].embedding.length > 0, "two vectors");
      return out({ dims: r.data[0].embedding.length });
    }
    case "errors": {
      try {
        await c.chat.completions.create({ model: "no-such-model", messages: USER });
      } catch (e) {
        check(e instanceof OpenAI.NotFoundError && e.status === 404, `NotFoundError (${e})`);
        return out({ status: e.status, code: e.code });
      }
      throw new Error("no error for an unknown model");
    }
    case "retry-429": {
      const { r, e } = await whileHeld(
        () => c.chat.completions.create({ model: chat, messages: USER, max_tokens: 400, stream: true }),
        (s) => s.controller.abort(),
        () => c.chat.completions.create({ model: chat, messages: USER, max_tokens: 4 }));
      if (e) throw e;
      check(statuses.includes(429) && statuses.at(-1) === 200, `retried after a 429 (${statuses})`);
      return out({ text: r.choices[0].message.content });
    }
  }
  throw new Error(`no cell ${cell}`);
}

async function ollamaCell() {
  const o = new Ollama({ host: base, fetch: countingFetch, headers: { authorization: `Bearer ${key}` } });
  switch (cell) {
    case "chat": {
      const r = await o.chat({ model: chat, messages: USER, options: { num_predict: 8 } });
      check(typeof r.message.content === "string" && r.eval_count > 0, "content and counts");
      return out({ text: r.message.content });
    }
    case "stream-usage": {
      let text = "", last = null;
      for await (const p of await o.chat({ model: chat, messages: USER, stream: true, options: { num_predict: 8 } })) {
        text += p.message.content;
        last = p;
      }
      check(last.done && last.eval_count > 0 && last.prompt_eval_count > 0, "the last part's counts");
      return out({ text, eval_count: last.eval_count });
    }
    case "abort": {
      const s = await o.chat({ model: chat, messages: USER, stream: true, options: { num_predict: 400 } });
      let n = 0;
      try {
        for await (const p of s) {
          if (p.message.content) n += 1;
          if (n >= READ) { s.abort(); break; }
        }
      } catch (e) {
        check(e.name === "AbortError", `aborted (${e})`);
      }
      check(n === READ, `read ${READ} pieces before aborting (got ${n})`);
      return out({ pieces: n });
    }
    case "structured": {
      const r = await o.chat({ model: chat, format: SCHEMA, options: { num_predict: 64 },
        messages: [{ role: "user", content: "Ann is 31. Give her name and age as JSON." }] });
      const v = JSON.parse(r.message.content);
      check(typeof v.name === "string" && Number.isInteger(v.age), "JSON of the schema");
      return out({ value: v });
    }
    case "tools": {
      const first = await o.chat({ model: chat, messages: USER, tools: [WEATHER], options: { num_predict: 64 } });
      const call = first.message.tool_calls?.[0];
      check(call && call.function.name === "weather", `a call of the tool (${JSON.stringify(first.message)})`);
      const second = await o.chat({ model: chat, tools: [WEATHER], options: { num_predict: 16 }, messages: [
        ...USER, first.message, { role: "tool", content: "sunny, 21 C" }] });
      check(typeof second.message.content === "string", "an answer after the tool's result");
      return out({ args: call.function.arguments, answer: second.message.content });
    }
    case "embeddings": {
      const r = await o.embed({ model: embed, input: ["hello", "world"] });
      check(r.embeddings.length === 2 && r.embeddings[0].length > 0, "two vectors");
      return out({ dims: r.embeddings[0].length });
    }
    case "errors": {
      try {
        await o.chat({ model: "no-such-model", messages: USER });
      } catch (e) {
        check(e.name === "ResponseError" && e.status_code === 404, `ResponseError 404 (${e})`);
        return out({ status: e.status_code });
      }
      throw new Error("no error for an unknown model");
    }
    case "retry-429": { // Ollama's client does not retry: the 429 reaches the caller
      const { e } = await whileHeld(
        () => o.chat({ model: chat, messages: USER, stream: true, options: { num_predict: 400 } }),
        (s) => s.abort(),
        () => o.chat({ model: chat, messages: USER, options: { num_predict: 4 } }));
      check(e && e.name === "ResponseError" && e.status_code === 429, `ResponseError 429 (${e})`);
      return out({ status: e.status_code, error: e.error });
    }
  }
  throw new Error(`no cell ${cell}`);
}

async function anthropicCell() {
  const retries = cell === "retry-429" ? 6 : 0;
  const c = new Anthropic({ baseURL: base, apiKey: key, maxRetries: retries, timeout: 120000, fetch: countingFetch });
  const TOOL = { name: "weather", description: "the weather in a city", input_schema: PARAMS };
  switch (cell) {
    case "chat": {
      const r = await c.messages.create({ model: chat, max_tokens: 8, messages: USER });
      check(r.content.every((b) => b.type === "text") && r.usage.output_tokens > 0, "text and usage");
      return out({ text: r.content.map((b) => b.text).join(""), stop: r.stop_reason });
    }
    case "stream-usage": {
      const s = c.messages.stream({ model: chat, max_tokens: 8, messages: USER });
      let text = "";
      s.on("text", (t) => { text += t; });
      const m = await s.finalMessage();
      check(m.usage.output_tokens > 0 && m.usage.input_tokens > 0, "the final message's usage");
      return out({ text, usage: m.usage });
    }
    case "abort": {
      const s = c.messages.stream({ model: chat, max_tokens: 400, messages: USER });
      let n = 0;
      try {
        for await (const ev of s) {
          if (ev.type === "content_block_delta") n += 1;
          if (n >= READ) { s.abort(); break; }
        }
      } catch (e) {
        check(e.name === "APIUserAbortError" || e.name === "AbortError", `aborted (${e})`);
      }
      check(n === READ, `read ${READ} pieces before aborting (got ${n})`);
      return out({ pieces: n });
    }
    case "structured": {
      const r = await c.messages.create({ model: chat, max_tokens: 64,
        messages: [{ role: "user", content: "Ann is 31. Give her name and age as JSON." }],
        output_config: { format: { type: "json_schema", schema: SCHEMA } } });
      const v = JSON.parse(r.content[0].text);
      check(typeof v.name === "string" && Number.isInteger(v.age), "JSON of the schema");
      return out({ value: v });
    }
    case "tools": {
      const first = await c.messages.create({ model: chat, max_tokens: 64, messages: USER, tools: [TOOL], tool_choice: { type: "tool", name: "weather" } });
      const use = first.content.find((b) => b.type === "tool_use");
      check(use && use.name === "weather" && first.stop_reason === "tool_use", "a tool_use block");
      const second = await c.messages.create({ model: chat, max_tokens: 16, tools: [TOOL], messages: [
        ...USER, { role: "assistant", content: first.content },
        { role: "user", content: [{ type: "tool_result", tool_use_id: use.id, content: "sunny, 21 C" }] }] });
      check(Array.isArray(second.content), "an answer after the tool's result");
      return out({ input: use.input, stop: second.stop_reason });
    }
    case "errors": {
      try {
        await c.messages.create({ model: "no-such-model", max_tokens: 8, messages: USER });
      } catch (e) {
        check(e instanceof Anthropic.NotFoundError && e.status === 404, `NotFoundError (${e})`);
        return out({ status: e.status, type: e.error?.error?.type });
      }
      throw new Error("no error for an unknown model");
    }
    case "retry-429": {
      const { r, e } = await whileHeld(
        () => c.messages.create({ model: chat, max_tokens: 400, messages: USER, stream: true }),
        (s) => s.controller.abort(),
        () => c.messages.create({ model: chat, max_tokens: 4, messages: USER }));
      if (e) throw e;
      check(statuses.includes(429) && statuses.at(-1) === 200, `retried after a 429 (${statuses})`);
      return out({ stop: r.stop_reason });
    }
  }
  throw new Error(`no cell ${cell}`);
}

const run = { openai: openaiCell, ollama: ollamaCell, anthropic: anthropicCell }[sdk];
if (!run) throw new Error(`no SDK ${sdk}`);
await run();

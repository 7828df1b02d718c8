// The playground's script: reads the model and its limits from GET /info,
// streams each answer from POST /v1/chat/completions (server-sent events read
// through fetch and a ReadableStream) and keeps the conversation's messages.
// Model output only ever goes into Text nodes (textContent, appendData): the
// page's CSP forbids inline code, and no text from the server is parsed as HTML.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);

  // /info's fields shown under the model id, with their labels.
  const LIMITS = [
    ["max_input_tokens", "max input tokens"],
    ["max_total_tokens", "max total tokens"],
    ["max_concurrent_requests", "max concurrent requests"],
    ["max_stop_sequences", "max stop sequences"],
    ["max_best_of", "max best_of"],
    ["max_client_batch_size", "max client batch size"],
  ];

  let history = [];       // the conversation so far: {role, content}, user and assistant turns
  let controller = null;  // the AbortController of the answer being streamed, else null

  class InputError extends Error {}

  function headers(extra) {
    const result = Object.assign({}, extra);
    const key = $("api-key").value.trim();
    if (key) result.Authorization = "Bearer " + key;
    return result;
  }

  async function errorText(response) {
    try {
      const body = await response.json();
      if (body && body.error) return `${response.status}: ${body.error}`;
    } catch (_) { /* not JSON */ }
    return `${response.status} ${response.statusText}`;
  }

  async function loadInfo() {
    const status = $("info-status");
    status.textContent = "";
    let response;
    try {
      response = await fetch("/info", { headers: headers() });
    } catch (err) {
      status.textContent = "Cannot reach the server: " + err.message;
      return;
    }
    if (response.status === 401) {
      status.textContent = "This server needs an API key to show its model and limits: enter it below.";
      return;
    }
    if (!response.ok) {
      status.textContent = "GET /info failed: " + (await errorText(response));
      return;
    }
    const info = await response.json();
    $("model-id").textContent = info.model_id;
    $("version").textContent = info.version ? "version " + info.version : "";
    const rows = [];
    for (const [field, label] of LIMITS) {
      if (info[field] === undefined || info[field] === null) continue;
      const row = document.createElement("div");
      row.dataset.field = field;
      const name = document.createElement("dt");
      name.textContent = label;
      const value = document.createElement("dd");
      value.textContent = String(info[field]);
      row.append(name, value);
      rows.push(row);
    }
    $("limits").replaceChildren(...rows);
  }

  // -- the request ---------------------------------------------------------

  function numberField(id, name, integer) {
    const input = $(id);
    const text = input.value.trim();
    if (input.validity.badInput) throw new InputError(`${name} is not a number`);
    if (text === "") return undefined;
    const value = Number(text);
    if (!Number.isFinite(value) || value < 0 || (integer && !Number.isInteger(value))) {
      throw new InputError(`${name} must be a non-negative ${integer ? "integer" : "number"}`);
    }
    return value;
  }

  function responseFormat() {
    const text = $("json-schema").value.trim();
    if (text === "") return undefined;
    let schema;
    try {
      schema = JSON.parse(text);
    } catch (err) {
      throw new InputError("The JSON schema is not valid JSON: " + err.message);
    }
    if (schema === null || typeof schema !== "object" || Array.isArray(schema)) {
      throw new InputError('The JSON schema must be a JSON object, such as {"type": "object"}');
    }
    return { type: "json_schema", json_schema: { name: "playground", schema } };
  }

  function requestBody(messages) {
    // logprobs: each token then arrives with its own entry, even one whose
    // text is still an incomplete UTF-8 sequence: tokens/s counts tokens.
    const body = { model: "tgi", messages, stream: true, stream_options: { include_usage: true }, logprobs: true };
    const numbers = {
      temperature: numberField("temperature", "temperature", false),
      top_p: numberField("top-p", "top_p", false),
      max_tokens: numberField("max-tokens", "max_tokens", true),
      seed: numberField("seed", "seed", true),
    };
    for (const [name, value] of Object.entries(numbers)) {
      if (value !== undefined) body[name] = value;
    }
    const stop = $("stop-sequences").value.split("\n").map((s) => s.replace(/\r$/, "")).filter((s) => s !== "");
    if (stop.length) body.stop = stop;
    const format = responseFormat();
    if (format) body.response_format = format;
    return body;
  }

  // -- the answer ----------------------------------------------------------

  // Feeds text chunks; calls onData with each event's data (its data: lines joined).
  function sseParser(onData) {
    let buffer = "";
    let data = [];
    return (chunk) => {
      buffer += chunk;
      const lines = buffer.split("\n");
      buffer = lines.pop();
      for (let line of lines) {
        if (line.endsWith("\r")) line = line.slice(0, -1);
        if (line === "") {
          if (data.length) onData(data.join("\n"));
          data = [];
        } else if (line.startsWith("data:")) {
          data.push(line.slice(line.startsWith("data: ") ? 6 : 5));
        }
      }
    };
  }

  async function streamAnswer(body, answer, signal) {
    // One Text node that grows: its data is never parsed as HTML, and appending
    // to it costs the new text only (setting textContent again would copy it all).
    const text = document.createTextNode("");
    answer.querySelector(".content").replaceChildren(text);
    const run = { text: "", tokens: 0, usage: null, started: performance.now(), first: null, last: null };
    const feed = sseParser((data) => {
      if (data === "[DONE]") return;
      const event = JSON.parse(data);
      if (event.error) throw new Error(event.error);
      if (event.usage) run.usage = event.usage;
      for (const choice of event.choices || []) {
        const tokens = choice.logprobs && choice.logprobs.content ? choice.logprobs.content.length : 0;
        const delta = choice.delta && choice.delta.content;
        if (!tokens && !delta) continue;
        run.last = performance.now();
        if (run.first === null) run.first = run.last;
        run.tokens += tokens || 1;
        if (delta) {
          run.text += delta;
          text.appendData(delta);
        }
      }
    });
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST", body: JSON.stringify(body), signal,
        headers: headers({ "Content-Type": "application/json", Accept: "text/event-stream" }),
      });
      if (!response.ok) throw new Error(await errorText(response));
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        feed(value);
      }
      run.state = "done";
    } catch (err) {
      run.state = err.name === "AbortError" ? "stopped" : "error";
      run.error = err.message;
    }
    return run;
  }

  function showStats(answer, run) {
    const tokens = run.usage ? run.usage.completion_tokens : run.tokens;
    const parts = [`${tokens} token${tokens === 1 ? "" : "s"}`];
    answer.dataset.tokens = String(tokens);
    if (run.first !== null) {
      const ttft = run.first - run.started;
      answer.dataset.ttftMs = ttft.toFixed(0);
      parts.push(`${ttft.toFixed(0)} ms to first token`);
    }
    if (tokens > 1 && run.last > run.first) {
      // The decode rate: tokens after the first over the time since the first.
      const rate = (tokens - 1) / ((run.last - run.first) / 1000);
      answer.dataset.tokensPerS = rate.toFixed(1);
      parts.push(`${rate.toFixed(1)} tokens/s`);
    }
    if (run.state === "stopped") parts.push("stopped");
    const stats = document.createElement("div");
    stats.className = "stats";
    stats.textContent = parts.join(" · ");
    answer.append(stats);
  }

  // -- the page ------------------------------------------------------------

  function addMessage(role, text) {
    const item = document.createElement("li");
    item.className = role;
    const label = document.createElement("div");
    label.className = "role";
    label.textContent = role;
    const content = document.createElement("div");
    content.className = "content";
    content.textContent = text;
    item.append(label, content);
    $("messages").append(item);
    item.scrollIntoView({ block: "end" });
    return item;
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("clear").disabled = busy;
    $("stop").disabled = !busy;
  }

  async function send() {
    const text = $("prompt").value;
    if (controller || text.trim() === "") return;
    const system = $("system").value.trim();
    const messages = [...(system ? [{ role: "system", content: system }] : []), ...history,
      { role: "user", content: text }];
    let body;
    try {
      body = requestBody(messages);
    } catch (err) {
      if (!(err instanceof InputError)) throw err;
      $("settings-error").textContent = err.message;
      return;
    }
    $("settings-error").textContent = "";
    $("prompt").value = "";
    addMessage("user", text);
    const answer = addMessage("assistant", "");
    answer.dataset.state = "streaming";
    controller = new AbortController();
    setBusy(true);
    const run = await streamAnswer(body, answer, controller.signal);
    controller = null;
    setBusy(false);
    if (run.state === "error") {
      answer.querySelector(".content").textContent = (run.text ? run.text + "\n\n" : "") + "Error: " + run.error;
    } else {
      if (run.text !== "" || run.state === "done") {
        history.push({ role: "user", content: text }, { role: "assistant", content: run.text });
      }
      showStats(answer, run);
    }
    answer.dataset.state = run.state;
    $("prompt").focus();
  }

  function checkSchema() {
    try {
      responseFormat();
      $("settings-error").textContent = "";
    } catch (err) {
      $("settings-error").textContent = err.message;
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("send").addEventListener("click", send);
    $("stop").addEventListener("click", () => controller && controller.abort());
    $("clear").addEventListener("click", () => {
      history = [];
      $("messages").replaceChildren();
    });
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        send();
      }
    });
    $("api-key").addEventListener("change", loadInfo);
    $("json-schema").addEventListener("input", checkSchema);
    loadInfo();
  });
})();

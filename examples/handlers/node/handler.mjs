#!/usr/bin/env node
// A handler for `shardq work --stdio -- node handler.mjs` (docs/stdio-protocol.md).
//
// shardq writes one JSON job per line on stdin (the job object of
// POST /v1/claim: id, shard, key, payload or payload_b64, attempt, receipt,
// fence, lease_expires_ms). For each line, in order, this writes exactly one
// result line on stdout, {"receipt": ..., "ok": true} or
// {"receipt": ..., "ok": false, "reason": ...}, and waits for it to be
// flushed before reading on. It exits when stdin closes. Logs go to stderr;
// stdout carries nothing but result lines.
//
// The work here is a demonstration: a payload that is a JSON object may ask
// for {"sleep_ms": N} or {"fail": "why"}; anything else is logged. Replace
// `work` with your own.

import { createInterface } from "node:readline";

const REASON_MAX = 1000;

/** Does the job's work; throws to fail the attempt. */
async function work(job, payload) {
  let request;
  try {
    request = JSON.parse(payload.toString("utf8"));
  } catch {
    request = undefined;
  }
  if (request !== null && typeof request === "object") {
    if (typeof request.sleep_ms === "number") await new Promise((r) => setTimeout(r, request.sleep_ms));
    if (typeof request.fail === "string") throw new Error(request.fail);
  }
  process.stderr.write(`handled ${job.id} key=${JSON.stringify(job.key)} attempt=${job.attempt} bytes=${payload.length}\n`);
}

function payloadOf(job) {
  if (typeof job.payload_b64 === "string") return Buffer.from(job.payload_b64, "base64");
  if (typeof job.payload === "string") return Buffer.from(job.payload, "utf8");
  throw new Error("job has neither payload nor payload_b64");
}

/** Writes one line and resolves once it is handed to the pipe. */
function writeLine(obj) {
  return new Promise((resolve, reject) => {
    process.stdout.write(JSON.stringify(obj) + "\n", (err) => (err ? reject(err) : resolve()));
  });
}

const lines = createInterface({ input: process.stdin, crlfDelay: Infinity });
for await (const line of lines) {
  if (line.trim() === "") continue;
  let job;
  try {
    job = JSON.parse(line);
  } catch (err) {
    // Without a receipt there is nothing to answer: leave, and shardq fails what it gave us.
    process.stderr.write(`handler: stdin line is not JSON (${err.message}): ${line.slice(0, 200)}\n`);
    process.exit(1);
  }
  if (job === null || typeof job !== "object" || typeof job.receipt !== "string") {
    process.stderr.write(`handler: job line has no receipt: ${line.slice(0, 200)}\n`);
    process.exit(1);
  }
  let result;
  try {
    await work(job, payloadOf(job));
    result = { receipt: job.receipt, ok: true };
  } catch (err) {
    const reason = (err instanceof Error ? err.message : String(err)) || "handler failed";
    result = { receipt: job.receipt, ok: false, reason: reason.slice(0, REASON_MAX) };
  }
  await writeLine(result);
}
// stdin closed: every line has been answered; exit normally.

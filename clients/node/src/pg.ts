/**
 * Enqueue inside your own Postgres transaction (`shardq pg install` wrote the outbox and its function; `shardq pg
 * relay` moves committed rows into the deployment). `client` is anything with node-postgres's
 * `query(text, values)`: a `pg` Client, a pooled client inside your transaction, a transaction helper.
 *
 *     import { enqueuePg } from "shardq";
 *     await enqueuePg(client, "tenant-42", "resize photo 7", { maxAttempts: 3 });
 *
 * The job exists if and only if the client's transaction commits. Bad input (an empty key, an oversized payload, a
 * reserved dedup id) is refused by the function, in that transaction, as the driver's error (SQLSTATE 22023).
 */

/** What `enqueuePg` needs of a Postgres client. */
export interface PgQueryable {
  query(text: string, values: unknown[]): Promise<{ rows: Array<Record<string, unknown>> }>;
}

/** Options of `enqueuePg`. */
export interface PgEnqueueOptions {
  dedupId?: string;
  delayMs?: number;
  maxAttempts?: number;
  /** The outbox's schema (`shardq` by default). */
  schema?: string;
}

const SCHEMA = /^[a-z_][a-z0-9_]{0,47}$/;

/** Writes a job for `key` into the outbox in `client`'s transaction; resolves to its row id. `payload`: a `Uint8Array` as given, a string as UTF-8, anything else as JSON (`jsonb`). */
export async function enqueuePg(client: PgQueryable, key: string, payload: unknown, opts: PgEnqueueOptions = {}): Promise<string> {
  const schema = opts.schema ?? "shardq";
  if (!SCHEMA.test(schema)) throw new TypeError(`schema ${JSON.stringify(schema)}: a lower-case SQL identifier, at most 48 bytes`);
  let value: unknown;
  let cast: string;
  if (payload instanceof Uint8Array) {
    value = Buffer.from(payload.buffer, payload.byteOffset, payload.byteLength);
    cast = "bytea";
  } else if (typeof payload === "string") {
    value = payload;
    cast = "text";
  } else {
    value = JSON.stringify(payload);
    cast = "jsonb";
  }
  const res = await client.query(`SELECT ${schema}.enqueue($1::text, $2::${cast}, $3::text, $4::bigint, $5::integer) AS id`, [
    key,
    value,
    opts.dedupId ?? null,
    opts.delayMs ?? null,
    opts.maxAttempts ?? null,
  ]);
  const id = res.rows[0]?.["id"];
  if (id === undefined || id === null) throw new Error(`${schema}.enqueue returned no id`);
  return String(id);
}

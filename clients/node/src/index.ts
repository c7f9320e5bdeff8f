export * from "./hashes.js";
export * from "./map.js";
export * from "./router.js";
export { lnCorrectlyRounded } from "./ln.js";
export { BadRequest, JobNotCancelled, KeyNotResumed, ServerUnavailable, ShardqError, StaleReceipt, Unauthorized, type HttpOptions } from "./http.js";
export {
  Client,
  ENQUEUE_BATCH_BYTES_MAX,
  ENQUEUE_BATCH_MAX,
  KEY_JOBS_MAX,
  type ClientOptions,
  type FinishedInfo,
  type FlowPolicy,
  type FlowSettings,
  type GroupInfo,
  type GroupSpec,
  type JobInfo,
  type KeyHold,
  type Moved,
  type EnqueueOptions,
  type EnqueueResult,
  type JobSpec,
  type Payload,
  type PolicyInfo,
  type PolicyScope,
  type PolicySpec,
  type PolicyTarget,
} from "./client.js";
export {
  BACKOFF_MS_MAX,
  FAIL_REASON_BYTES_MAX,
  JOB_TIMEOUT_MS_MAX,
  JOB_TIMEOUT_MS_MIN,
  JobTimeout,
  BackOff,
  CLAIM_MAX,
  RetryLater,
  Worker,
  type ClaimedJob,
  type Handler,
  type JobContext,
  type Logger,
  type RunOptions,
  type StopOptions,
  type WorkerOptions,
  type WorkerStats,
} from "./worker.js";

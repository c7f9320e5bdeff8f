export * from "./hashes.js";
export * from "./map.js";
export * from "./router.js";
export { lnCorrectlyRounded } from "./ln.js";
export * from "./http.js";
export * from "./client.js";
export * from "./worker.js";

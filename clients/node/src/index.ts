export * from "./hashes.js";
export * from "./map.js";
export * from "./router.js";
export { lnCorrectlyRounded } from "./ln.js";

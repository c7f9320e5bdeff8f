// The package ships no types; this declares the one function used here.
declare module "murmurhash3js-revisited" {
  interface MurmurHash3 {
    x64: {
      /** MurmurHash3 x64_128 of `bytes`: 32 hex digits, h1 then h2, each big-endian. */
      hash128(bytes: Uint8Array | number[], seed?: number): string;
    };
  }
  const murmurHash3: MurmurHash3;
  export default murmurHash3;
}

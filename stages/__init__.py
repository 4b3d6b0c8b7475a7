"""Pure computation, one module per stage; no terminal code. Reads and writes through artifacts/."""

"""The backbone: loading (models), residual-stream capture (capture), the upper-blocks suffix (hybrid)."""

"""TokenTune and token selection: gradients against their definition, heads, inputs, the run-time invariant, resume,
the chunked loss."""

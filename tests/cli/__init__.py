"""The peft-slim command line: flags, inputs, output, peft-slim train end to end, the SFT data reader."""

"""The tuner as PEFT sees it: the adapter API, registration, PEFT's generic suite, config checks, refusals, the
training context, the full fine-tuning transforms, copies."""

"""The prefix cache: SGLang's radix-cache backend over the logical tree, and the slot census."""

"""The BF16 gradient path: parameter families (`families`), precision policies as data (`policy`,
`catalogue`), the path itself (`path`), its FP32/FP64 oracles (`oracle`) and probes (`probes`)."""

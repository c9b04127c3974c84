"""Studies built on the lab: the #8913 reproduction (the package `repro`: its configuration `repro.config`, its
verdict `repro.verdict`, its report `repro.report`) with its power checks (`power`), the same study at production
shapes (`production`), MoE training next to the matched FP32 policy (`training`), real-backend cross-checks
(`crosscheck`, `dumps`) and error growth over many steps (the package `growth`: `growth.stream`, `growth.metrics`,
`growth.run`, `growth.plot`, `growth.files`)."""

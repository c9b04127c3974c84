"""Studies built on the lab: the #8913 reproduction (`repro`) with its power checks (`power`), the same study at
production shapes (`production`), MoE training next to the matched FP32 policy (`training`), real-backend cross-checks
(`crosscheck`, `dumps`) and error growth over many steps (`growth`)."""

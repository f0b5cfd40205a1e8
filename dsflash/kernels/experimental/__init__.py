"""Kernel variants that are not defaults, kept runnable for the bench, the GPU tests and the compile tools, with the
benchmark JSON that judged each (README.md here). Nothing on the default path (the model, the dispatch) imports this
package; look MoE configs up with ``dsflash.kernels.moe_plan.named_config``."""

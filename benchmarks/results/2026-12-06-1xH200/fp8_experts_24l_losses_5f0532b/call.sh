# The same H200, warm, the call after ../fp8_experts_24l_three_5f0532b/ (device tool, carry .gpu/base), with that
# folder's call.sh as callRS.sh:
#   COMMIT=5f0532b PART=losses LIMIT=235 bash callRS.sh
# PART=losses runs:
#   OUT=$R/l24_losses PART=losses TIMEOUT=240 bash benchmarks/fp8_experts_compiled_h200.sh \
#     model.overrides.num_hidden_layers=24 train.micro_batch_size=3 optim.stochastic_rounding=true train.profile=true

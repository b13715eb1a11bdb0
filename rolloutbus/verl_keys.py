"""What each key of a verl trainer config means here: read (and under which of our names),
accepted and ignored (with the reason), or kept but not acted on.

A whole verl trainer file loads (``verl/trainer/config/_generated_ppo*_trainer.yaml`` of
verl 0.7.0 through 0.9.1 and main 1dda039, or a user's GRPO yaml): ``rolloutbus.config_loading``
walks it with these tables. Every key those releases generate is in them (checked by
``tests/verl_compat/test_verl_releases.py`` against the key lists that
``ops/verl_release_keys.py`` makes from the releases' files), so a verl key is never taken
for a typo; a key only an older release has says so in a comment. Keys are
named as written in verl's layout, except that ``actor_rollout_ref.rollout`` is read as our
``rollout`` section (a verl rollout block may also be pasted under ``rollout:``), so its
keys are named ``rollout.x`` here. A key names its whole subtree. ``_target_`` (hydra's
class to instantiate) is accepted at any depth. A key in none of these tables and not in
the config models is an error that names it and suggests the nearest known key.

Nothing here imports the config models: ``rolloutbus.config`` imports this module.
"""

from __future__ import annotations

from typing import Any

# verl key -> our key. ``actor_rollout_ref.rollout`` (the whole block) is read as ``rollout``;
# the others are single keys. Keys that verl and Rollout Bus share by name (``data.*``,
# ``trainer.*``, ``algorithm.*``, ``reward.*``, ``custom_reward_function.*`` where the
# models have them) are read as they are and are not listed.
ROLLOUT_BLOCK = "actor_rollout_ref.rollout"
VERL_KEYS_READ: dict[str, str] = {
    ROLLOUT_BLOCK: "rollout",
    "actor_rollout_ref.actor.optim.lr": "actor.optim.lr",
    "actor_rollout_ref.actor.optim.weight_decay": "actor.optim.weight_decay",
    "actor_rollout_ref.actor.optim.betas": "actor.optim.betas",
    "actor_rollout_ref.actor.optim.clip_grad": "actor.optim.clip_grad",
    "actor_rollout_ref.actor.clip_ratio": "actor.clip_ratio",
    "actor_rollout_ref.actor.clip_ratio_low": "actor.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high": "actor.clip_ratio_high",
    "actor_rollout_ref.actor.clip_ratio_c": "actor.clip_ratio_c",
    "actor_rollout_ref.actor.loss_agg_mode": "actor.loss_agg_mode",
    # verl counts prompts per mini-batch (it multiplies by rollout.n itself): prompt groups
    "actor_rollout_ref.actor.ppo_mini_batch_size": "async_training.ppo_mini_batch_size",
    # the policy: the model the replicas serve, whose tokenizer the workers use, and that
    # `rolloutbus train` trains (a local folder or a bundled name; nothing is downloaded)
    "actor_rollout_ref.model.path": "model.name",
}

# verl keys that a pasted ``actor_rollout_ref.rollout`` block carries and that have no
# meaning here. They are validated and kept on the config (a ported loop may read them),
# never acted on; load_config logs a warning when one is set to a non-default value.
VERL_KEYS_ACCEPTED_NOT_USED: dict[str, str] = {
    "rollout.agent.num_workers": "verl's number of AgentLoopWorker actors; here each "
    "`rolloutbus sessions run` process "
    "is one worker (start more to scale out) and sessions.concurrency sets the prompt "
    "groups in flight per worker",
    "rollout.multi_turn.enable": "routing is by the row's agent_name (tool_agent for tool calls, "
    "rollout.agent.default_agent_loop when the field is absent), not by this switch",
    "rollout.val_kwargs.do_sample": "verl's agent-loop path does not read it either: validation "
    "samples with val_kwargs.temperature/top_p/top_k (temperature 0 is greedy)",
}

_ENGINE = "an inference-engine setting: replicas are launched and configured outside the bus"
_TRAINER = "a trainer-side setting (log-prob micro-batching, weight sync, profiling)"
_SERVING = "verl's own Ray-based serving (servers, routers, tracing, metrics exporters)"
_DATALOADER = "verl's torch DataLoader/RLHFDataset, not used: the publisher streams the rows"
_PARALLEL = (
    "how verl shards and batches training over GPUs (FSDP, sequence parallelism, micro-batches, "
    "offload, compilation): `rolloutbus train` trains one model in one process"
)
_LOSS = (
    "a loss term or variant the trainer here does not implement: it minimises verl's "
    "PPO-clip loss (vanilla policy_loss) on the GRPO advantage, weighted by truncated "
    "importance weights (algorithm.rollout_correction)"
)
_OPTIM = "the optimizer here is torch AdamW at a constant learning rate (actor.optim)"
_MODEL = (
    "how verl builds and patches the HF model (remote code, kernels, LoRA, gradient "
    "checkpointing): model.name is loaded as it is"
)
_NO_REF = (
    "there is no reference model here: the trainer computes no KL against one (verl's "
    "use_kl_loss / use_kl_in_reward)"
)
_NO_CRITIC = "GRPO trains without a critic (verl uses it for GAE only)"
_NO_REWARD_MODEL = (
    "rewards are rule-based, computed in the session workers (reward.custom_reward_function or "
    "verl's default_compute_score); reward models are not supported"
)
_SANDBOX = (
    "the code-execution sandbox of verl's code scorers; those scorers are not ported (they "
    "raise NotImplementedError naming themselves)"
)
_RAY = "verl's Ray cluster, single controller and profiling: the services here are processes"
_OFF = "a verl feature that does not exist here (distillation, transfer queue, rollout dumps)"
_SCHEDULE = (
    "verl's synchronous schedule: here `rolloutbus dispatch --epochs` feeds epochs, "
    "`rolloutbus publish --val` validation rows, and the trainer checkpoints every "
    "policy version it publishes"
)
_TRACKING = (
    "run bookkeeping of verl's trainer (names, tracking backends' options, resuming, HDFS): "
    "here the trainer resumes from trainer.default_local_dir and keeps "
    "trainer.max_checkpoints_to_keep"
)
_ALGORITHM = (
    "an advantage or reward shaping other than GRPO's (GAE, KL in reward, dynamic sampling, PF-PPO)"
)
_CORRECTION = (
    "rollout correction beyond truncated importance weights (rejection sampling, bypass mode, "
    "batch normalisation)"
)
_REWARD_LOOP = (
    "verl's reward-loop workers and managers: the session workers score each session as "
    "verl's naive reward manager does"
)


def _under(prefix: str, keys: str, reason: str) -> dict[str, str]:
    return dict.fromkeys((f"{prefix}.{k}" for k in keys.split()), reason)


# verl keys that are accepted and dropped at load time, because what they configure does not
# exist here; load_config lists the ones a config sets in one log line at start-up.
VERL_KEYS_IGNORED: dict[str, str] = {
    # -- actor_rollout_ref.rollout (read as rollout) --------------------------------------
    **_under(
        "rollout",
        "name mode nnodes n_gpus_per_node seed dtype gpu_memory_utilization ignore_eos "
        "enforce_eager cudagraph_capture_sizes free_cache_engine tensor_model_parallel_size "
        "data_parallel_size expert_parallel_size pipeline_model_parallel_size "
        "max_num_batched_tokens max_num_seqs enable_chunked_prefill enable_prefix_caching "
        "logprobs_mode scheduling_policy load_format layered_summon disable_log_stats "
        "multi_stage_wake_up engine_kwargs skip_tokenizer_init quantization "
        "quantization_config_file mtp qat disaggregation limit_images "
        "moe_load_balance_metrics_interval "
        "standalone_gpu_memory_utilization moe_tensor_parallel_size layer_name_map "
        "sglang_engine_mode enable_sleep_mode",
        _ENGINE,
    ),
    **_under(
        "rollout",
        "log_prob_micro_batch_size log_prob_micro_batch_size_per_gpu log_prob_use_dynamic_bsz "
        "log_prob_max_token_len_per_gpu checkpoint_engine profiler "
        # verl 0.7.0; under checkpoint_engine from 0.7.1
        "update_weights_bucket_megabytes",
        _TRAINER,
    ),
    **_under(
        "rollout",
        "agent.custom_async_server agent.agent_loop_manager_class server "
        "custom checkpoint_manager_class trace prometheus",
        _SERVING,
    ),
    "rollout.do_sample": "verl's agent-loop path does not read it either (temperature 0 is greedy)",
    "rollout.over_sample_rate": "verl's synchronous over-sampling; here groups stream and the "
    "replay buffer releases each when it is complete",
    "rollout.multi_turn.use_inference_chat_template": "observation tokens come from the "
    "continuous-token builder, as in current verl",
    "rollout.multi_turn.tokenization_sanity_check_mode": "assistant tokens are never "
    "re-tokenized here, so there is nothing to check",
    "rollout.multi_turn.num_repeat_rollouts": "removed from verl's loop (interactions)",
    "rollout.multi_turn.interaction_config_path": "verl 0.7's interactions (a scripted user "
    "answering in the tool loop; gone from verl 0.8's config) are not supported here",
    # rollout dumps: rollout.skip_rollout/skip_dump_dir (verl 0.7), rollout.skip (0.8), the
    # top-level skip (0.9)
    **_under("rollout", "skip skip_rollout skip_dump_dir", _OFF),
    # -- actor_rollout_ref.{actor,model,ref} ----------------------------------------------
    "actor_rollout_ref.hybrid_engine": _PARALLEL,
    "actor_rollout_ref.nccl_timeout": _PARALLEL,
    "actor_rollout_ref.ref": _NO_REF,
    **_under(
        "actor_rollout_ref.actor",
        "fsdp_config strategy ppo_micro_batch_size ppo_micro_batch_size_per_gpu use_dynamic_bsz "
        "ppo_max_token_len_per_gpu use_torch_compile ulysses_sequence_parallel_size "
        "entropy_from_logits_with_chunking entropy_from_logits_chunk_size entropy_checkpointing "
        "pad_to_length use_remove_padding use_fused_kernels qat freeze_vision_tower "
        "use_prefix_grouper data_loader_seed shuffle megatron torchtitan veomni "
        # verl 0.7.1
        "sum_pi_squared_checkpointing",
        _PARALLEL,
    ),
    **_under(
        "actor_rollout_ref.actor",
        "policy_loss tau_pos tau_neg loss_scale_factor entropy_coeff calculate_entropy "
        "calculate_sum_pi_squared use_kl_loss kl_loss_coef kl_loss_type ppo_epochs",
        _LOSS,
    ),
    "actor_rollout_ref.actor.rollout_n": "verl's copy of rollout.n (an interpolation)",
    "actor_rollout_ref.actor.grad_clip": "verl's engine clips with optim.clip_grad, read as "
    "actor.optim.clip_grad",
    "actor_rollout_ref.actor.checkpoint": "what verl's checkpoints contain: here always the "
    "weights, the AdamW state and the trajectory position",
    "actor_rollout_ref.actor.profiler": _RAY,
    # verl 0.7.0 to 0.9.0 (and main 1dda039); under actor.megatron/veomni from 0.9.1
    "actor_rollout_ref.actor.router_replay": "the training engine's MoE router replay "
    "(R2/R3 mode): `rolloutbus train` does not replay routes; R3's rollout side, recording "
    "the experts into the trajectory, is rollout.enable_rollout_routing_replay",
    "actor_rollout_ref.actor.load_weight": _MODEL,  # verl 0.7.0 to 0.8.0
    **_under(
        "actor_rollout_ref.actor.optim",
        "optimizer optimizer_impl lr_warmup_steps_ratio total_training_steps lr_warmup_steps "
        "min_lr_ratio num_cycles lr_scheduler_type zero_indexed_step warmup_style "
        "override_optimizer_config "
        # the Megatron, TorchTitan and VeOmni engines' optimizer settings
        "lr_warmup_init lr_decay_steps lr_decay_style min_lr weight_decay_incr_style "
        "lr_wsd_decay_style lr_wsd_decay_steps use_checkpoint_opt_param_scheduler "
        "use_precision_aware_optimizer main_grads_dtype exp_avg_dtype exp_avg_sq_dtype "
        "use_layer_wise_distributed_optimizer muon_momentum muon_nesterov muon_split_qkv "
        "muon_scale_mode muon_coefficient_type muon_num_ns_steps muon_tp_mode "
        "muon_fp32_matmul_prec muon_extra_scale_factor muon_scalar_optimizer "
        "muon_match_adamw_update_rms name eps decay_type min_lr_factor lr_min lr_start "
        "lr_decay_ratio",
        _OPTIM,
    ),
    **_under(
        "actor_rollout_ref.model",
        "hf_config_path use_shm trust_remote_code custom_chat_template external_lib "
        "override_config enable_gradient_checkpointing enable_activation_offload "
        "use_remove_padding lora_rank lora_alpha target_modules exclude_modules "
        "lora_adapter_path use_liger use_fused_kernels fused_kernel_options tiled_mlp mtp lora",
        _MODEL,
    ),
    "actor_rollout_ref.model.tokenizer_path": "the tokenizer is model.name's own",
    # -- whole sections -------------------------------------------------------------------
    "critic": _NO_CRITIC,
    "reward_model": _NO_REWARD_MODEL,
    "sandbox_fusion": _SANDBOX,
    "distillation": _OFF,
    "transfer_queue": _OFF,
    "skip": _OFF,
    "reward_manager": _REWARD_LOOP,  # verl 0.7.0; reward.reward_manager from 0.7.1
    "global_profiler": _RAY,
    "ray_kwargs": _RAY,
    # -- reward ---------------------------------------------------------------------------
    "reward.num_workers": _REWARD_LOOP,
    "reward.reward_manager": _REWARD_LOOP,
    "reward.reward_model": _NO_REWARD_MODEL,
    "reward.sandbox_fusion": _SANDBOX,
    # -- algorithm ------------------------------------------------------------------------
    **_under(
        "algorithm",
        "gamma lam filter_groups use_kl_in_reward kl_penalty kl_ctrl use_pf_ppo pf_ppo",
        _ALGORITHM,
    ),
    **_under(
        "algorithm.rollout_correction",
        "rollout_rs rollout_rs_threshold bypass_mode loss_type rollout_is_batch_normalize "
        # verl 0.7.0
        "rollout_rs_threshold_lower rollout_token_veto_threshold",
        _CORRECTION,
    ),
    # -- trainer --------------------------------------------------------------------------
    **_under(
        "trainer",
        "nnodes n_gpus_per_node device balance_batch ray_wait_register_center_timeout use_v1 v1 "
        "esi_redundant_time "
        # verl 0.7: which of verl's worker implementations runs
        "use_legacy_worker_impl",
        _PARALLEL,
    ),
    **_under(
        "trainer",
        "total_epochs save_freq test_freq val_before_train val_only critic_warmup "
        "log_val_generations rollout_data_dir validation_data_dir",
        _SCHEDULE,
    ),
    **_under(
        "trainer",
        "project_name experiment_name resume_mode resume_from_path checkpoint_callback_class "
        "default_hdfs_dir del_local_ckpt_after_load max_actor_ckpt_to_keep "
        "max_critic_ckpt_to_keep",
        _TRACKING,
    ),
    # -- data -----------------------------------------------------------------------------
    **_under(
        "data",
        "tokenizer use_shm train_batch_size gen_batch_size val_batch_size return_raw_input_ids "
        "return_raw_chat return_full_prompt shuffle seed dataloader_num_workers image_patch_size "
        "validation_shuffle filter_overlong_prompts filter_overlong_prompts_workers truncation "
        "trust_remote_code custom_cls return_multi_modal_inputs tool_config_path "
        "function_tool_path "
        # verl 0.7: the curriculum sampler's class, a dataset that generates rows
        "sampler datagen",
        _DATALOADER,
    ),
    "data.continuous_token": "verl 0.9.0's switch for Continuous Token (off by default "
    "there); here a multi-turn session always keeps the sampled token stream, as verl 0.9.1's "
    "agent loop always does",
    "data.reward_fn_key": "read by verl's legacy batch reward managers only; its streaming "
    "reward loop (naive manager), which the session workers follow, reads data_source",
    **dict.fromkeys(
        ("data.video_key", "data.audio_key"),
        "video and audio rows are not supported: a row with videos or audios is refused",
    ),
}

# Ignored verl keys whose other values would make verl compute something this system does
# not: key -> (the values that behave as here, what happens here instead). load_config
# warns, naming the value, when a config sets another one.
VERL_VALUES_NOT_SUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "algorithm.adv_estimator": (
        ("grpo",),
        "`rolloutbus train` implements GRPO only and refuses to start with another estimator",
    ),
    "algorithm.use_kl_in_reward": ((False, None), "no KL penalty is added to the reward"),
    "algorithm.filter_groups.enable": ((False, None), "every group is trained (no filtering)"),
    "algorithm.rollout_correction.rollout_rs": ((None,), "no rejection sampling"),
    "actor_rollout_ref.actor.use_kl_loss": ((False, None), "no KL loss is added"),
    "actor_rollout_ref.actor.entropy_coeff": ((0, None), "no entropy bonus is added"),
    "actor_rollout_ref.actor.ppo_epochs": ((1, None), "each batch is trained on once"),
    "actor_rollout_ref.actor.policy_loss.loss_mode": (("vanilla", None), "PPO-clip is used"),
    # Megatron's "adam" decouples weight decay (apex/TE FusedAdam in AdamW mode): AdamW too
    "actor_rollout_ref.actor.optim.optimizer": (
        ("AdamW", "adamw", "adam", None),
        "torch AdamW is used",
    ),
    "actor_rollout_ref.actor.optim.lr_scheduler_type": (
        ("constant", None),
        "the learning rate is constant",
    ),
    "actor_rollout_ref.actor.optim.lr_warmup_steps": ((-1, 0, None), "there is no warmup"),
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": ((0, None), "there is no warmup"),
    "actor_rollout_ref.model.lora_rank": ((0, None), "every weight is trained (no LoRA)"),
    "actor_rollout_ref.model.tokenizer_path": ((None,), "the tokenizer of model.name is used"),
    "reward_model.enable": ((False, None), "rewards are rule-based (no reward model)"),
    "reward.reward_model.enable": ((False, None), "rewards are rule-based (no reward model)"),
    "reward.reward_manager.name": (("naive", None), "sessions are scored as by verl's naive"),
    "reward_manager.name": (("naive", None), "sessions are scored as by verl's naive"),
}

# the tracking backends verl's trainer.logger accepts (verl.utils.tracking.Tracking); here
# "console" is the trainer's progress line and "file" its JSONL log (trainer.metrics_log)
VERL_LOGGERS = (
    "console",
    "file",
    "wandb",
    "mlflow",
    "swanlab",
    "vemlp_wandb",
    "tensorboard",
    "clearml",
    "trackio",
    "rl_insight",
)


def ignored_reason(key: str) -> str | None:
    """Why ``key`` (or the section it is in) is ignored; None when it is not."""
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        reason = VERL_KEYS_IGNORED.get(".".join(parts[:i]))
        if reason is not None:
            return reason
    return None


def read_as(key: str) -> str | None:
    """Our name for the verl key ``key``, when it is one that is read (or is under one)."""
    for verl, ours in VERL_KEYS_READ.items():
        if key == verl or key.startswith(verl + "."):
            return ours + key[len(verl) :]
    return None


def verl_name(key: str) -> str:
    """The name ``key`` has in verl's layout: ``rollout.x`` is ``actor_rollout_ref.rollout.x``."""
    for verl, ours in VERL_KEYS_READ.items():
        if key == ours or key.startswith(ours + "."):
            return verl + key[len(ours) :]
    return key


def layout_name(key: str) -> str:
    """How the tables name ``key``: verl's ``actor_rollout_ref.rollout.x`` is ``rollout.x``."""
    if key == ROLLOUT_BLOCK or key.startswith(ROLLOUT_BLOCK + "."):
        return "rollout" + key[len(ROLLOUT_BLOCK) :]
    return key


def verl_sections() -> set[str]:
    """Every section above a read or ignored verl key (``actor_rollout_ref``,
    ``actor_rollout_ref.actor`` ...): walked into, never an unknown key themselves."""
    out: set[str] = set()
    for key in (*VERL_KEYS_READ, *VERL_KEYS_IGNORED, *VERL_VALUES_NOT_SUPPORTED):
        parts = key.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return out

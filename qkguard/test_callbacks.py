"""qkguard/callbacks.py and qkguard/serve.py: the guard under transformers.Trainer, and a fired model served.

Needs transformers (and accelerate, which Trainer needs); skipped without them. A tiny Llama on fixed
random tokens, its W_q and W_k inflated so that the guard fires within the first updates.
"""
import json
import math
import os

import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

import qkguard                                            # noqa: E402
from qkguard import serve                                 # noqa: E402
from qkguard.callbacks import STATE_FILE, QKGuardCallback  # noqa: E402
from qkguard.test_attach import VOCAB, batch, build, inflate_qk, train_steps  # noqa: E402

STEPS, SAVE_AT = 6, 3         # the uninterrupted run's updates, and the checkpoint the resumed one starts from


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64, t=16):
        self.x = torch.randint(0, VOCAB, (n, t), generator=torch.Generator().manual_seed(3))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


class Tracker(transformers.TrainerCallback):
    """A report_to tracker's place in the list (before the user's callbacks): what it is handed to log."""
    def __init__(self):
        self.logged = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logged.append((state.global_step, dict(logs)))


class Stop(transformers.TrainerCallback):
    """The interruption: training ends after update `at` (and its checkpoint), as a killed job would."""
    def __init__(self, at):
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.at


def train(out, stop=STEPS, resume=None, missing_ok=False, **guard_settings):
    """A Trainer run of STEPS updates, ended after `stop` or resumed from the checkpoint `resume`: its logs
    and guard. (STEPS for all: the learning rate schedule follows max_steps.)"""
    transformers.set_seed(0)
    model, _ = build("hf-llama")
    inflate_qk(model, 8.0)
    guard = qkguard.attach(model, **{"threshold": 3.0, **guard_settings})
    tracker = Tracker()
    args = transformers.TrainingArguments(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=4,
                                          learning_rate=1e-3, logging_steps=1, save_steps=SAVE_AT, save_strategy="steps",
                                          report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
                                          dataloader_num_workers=0, save_only_model=False)
    callback = QKGuardCallback(guard, missing_ok=missing_ok)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[tracker, callback, Stop(stop)])
    trainer.train(resume_from_checkpoint=resume)
    losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    return losses, guard, callback, tracker, trainer


def test_a_resumed_trainer_run_is_the_uninterrupted_one_bit_for_bit(tmp_path):
    """6 updates in one go, against 3, a checkpoint, and a new Trainer resumed from it for the other 3:
    the same losses and the same guard state bit for bit, the guard having fired before the checkpoint."""
    whole, guard, callback, tracker, _ = train(tmp_path / "whole")
    assert guard.triggered and callback.events[0]["active_from"] <= SAVE_AT, "the check needs a fire before the save"
    train(tmp_path / "parts", stop=SAVE_AT)
    saved = tmp_path / "parts" / f"checkpoint-{SAVE_AT}"
    assert (saved / STATE_FILE).exists()
    later, resumed, resumed_callback, _, _ = train(tmp_path / "parts", resume=str(saved))
    assert resumed.triggered and resumed.steps == guard.steps == STEPS
    # the events, fired before the checkpoint, come back: the guard's from its state, the callback's (in
    # Trainer's numbering) from trainer_state.json
    assert resumed.events == guard.events != [] and resumed_callback.events == callback.events
    assert later == whole and set(whole) == set(range(1, STEPS + 1))   # the resumed history holds steps 1-3 too
    a, b = guard.state_dict(), resumed.state_dict()
    assert a["guard"]["trigger"] == b["guard"]["trigger"] and torch.equal(a["generator"], b["generator"])
    assert all(torch.equal(a["sigma_v"][k], b["sigma_v"][k]) for k in a["sigma_v"])
    assert torch.equal(guard.max_logit, resumed.max_logit)


def test_events_and_signals_reach_the_trackers_at_trainers_global_step(tmp_path):
    """The guard counts updates from 0, Trainer from 1: the event is logged in Trainer's numbering, at the
    step the guard acts, in the logs a tracker listed before the callback is handed, and in log_history."""
    _, guard, callback, tracker, trainer = train(tmp_path, stop=4)
    (event,) = guard.events
    (logged,) = callback.events
    assert logged["step"] == event["step"] + 1 and logged["active_from"] == event["active_from"] + 1
    at = {step: logs for step, logs in tracker.logged if "loss" in logs}    # not the end-of-training summary
    acted = logged["active_from"] - 1                          # the update after which guard.step() acted
    assert at[acted]["qkguard/guard_trigger/step"] == logged["step"] and at[acted]["qkguard/on"] == 1.0
    assert all("qkguard/max_logit" in at[s] for s in range(1, 5))
    history = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    assert history[acted]["qkguard/guard_trigger/value"] == pytest.approx(logged["value"])
    assert math.isfinite(history[4]["qkguard/sigma_product"])


def test_a_resume_from_a_checkpoint_without_the_guards_state_is_refused_in_one_line(tmp_path):
    train(tmp_path, stop=SAVE_AT)
    saved = tmp_path / f"checkpoint-{SAVE_AT}"
    file = torch.load(saved / STATE_FILE, weights_only=True)
    torch.save({**file, "token": "another save's"}, saved / STATE_FILE)       # one from another checkpoint
    with pytest.raises(ValueError, match=rf"was saved with another checkpoint than the one this run resumes"):
        train(tmp_path, resume=str(saved))
    os.remove(saved / STATE_FILE)
    with pytest.raises(FileNotFoundError, match=rf"has no {STATE_FILE} .*QKGuardCallback\(guard, missing_ok=True\)"):
        train(tmp_path, resume=str(saved))
    # a checkpoint saved without the callback at all: missing_ok starts the guard anew, and the Trainer's next
    # save, which updates the callback's entry in trainer_state.json, finds one (it raised KeyError)
    trainer_state = json.loads((saved / "trainer_state.json").read_text())
    trainer_state["stateful_callbacks"].pop("QKGuardCallback")
    (saved / "trainer_state.json").write_text(json.dumps(trainer_state))
    _, guard, _, _, trainer = train(tmp_path, resume=str(saved), missing_ok=True)
    assert trainer.state.global_step == STEPS and (tmp_path / f"checkpoint-{STEPS}" / STATE_FILE).exists()


def test_load_guard_reads_a_trainer_checkpoint_and_refuses_a_half_written_file_in_one_line(tmp_path):
    """The callback's qkguard.pt is save_guard's format: load_guard takes a checkpoint-<step> folder, and
    gives the saved guard, fired. A file cut short (a save killed midway) is one line naming it."""
    _, guard, _, _, _ = train(tmp_path, stop=SAVE_AT)
    saved = tmp_path / f"checkpoint-{SAVE_AT}"
    model = transformers.AutoModelForCausalLM.from_pretrained(saved)
    served = serve.load_guard(model, saved)
    assert served.triggered and served.steps == guard.steps == SAVE_AT
    assert served._settings() == guard._settings()
    served.detach()
    data = (saved / STATE_FILE).read_bytes()
    (saved / STATE_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"^serve: {saved / STATE_FILE} cannot be read as a guard file .*half-written"):
        serve.load_guard(model, saved)
    torch.save(guard.state_dict(), saved / STATE_FILE)      # a bare state: no settings to attach with
    with pytest.raises(ValueError, match=r"is not a guard file .*attach\(model, ...\) with the run's settings"):
        serve.load_guard(model, saved)


# --------------------------------------------------------------------------------------------------
# Serving a fired model (serve.py)

def fired(name):
    """A model of test_attach's `name` that the guard fired on (qknorm, every layer), and its guard."""
    model, loss_of = build(name)
    inflate_qk(model)
    guard = qkguard.attach(model, threshold=1.0)
    train_steps(model, loss_of, guard, 2)
    assert guard.triggered and guard.qkguard.layers == [0, 1]
    return model.eval(), guard


def logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits


def test_a_fired_llama_exported_to_qwen3_gives_the_same_logits_and_generation(tmp_path):
    """Saved and loaded as a Qwen3ForCausalLM, with no guard: bit for bit the guarded Llama's logits and
    greedy generate(); the same weights loaded bare as a Llama give other logits."""
    model, guard = fired("hf-llama")
    x = batch()[0]
    guarded = logits(model, x)
    prompt = x[:, :4]
    generated = model.generate(prompt, max_new_tokens=10, do_sample=False)
    serve.to_qwen3(model, guard).save_pretrained(tmp_path / "qwen3")
    qwen3 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "qwen3")
    assert type(qwen3).__name__ == "Qwen3ForCausalLM" and not qkguard.attached(qwen3)
    assert torch.equal(logits(qwen3, x), guarded)
    assert torch.equal(qwen3.generate(prompt, max_new_tokens=10, do_sample=False), generated)
    guard.detach()                                          # the weights alone: what from_pretrained would give
    assert (logits(model, x) - guarded).abs().max() > 0.1


def test_a_fired_model_of_another_family_is_served_with_its_guard_state_beside_it(tmp_path):
    model, guard = fired("hf-gpt2")
    x = batch()[0]
    guarded = logits(model, x)
    model.save_pretrained(tmp_path)
    serve.save_guard(guard, tmp_path)
    bare = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert (logits(bare, x) - guarded).abs().max() > 0.1, "loaded bare, a fired model is another function"
    served = serve.load_guard(bare, tmp_path)               # the action back on, from the next forward
    assert served.triggered and torch.equal(logits(bare, x), guarded)


def test_serving_refuses_what_it_cannot_serve_in_one_line(tmp_path):
    model, guard = fired("hf-gpt2")
    with pytest.raises(ValueError, match=r"to_qwen3 takes a LlamaForCausalLM, not GPT2LMHeadModel: .*save_guard\(\)"):
        serve.to_qwen3(model, guard)
    llama, _ = build("hf-llama")
    dormant = qkguard.attach(llama)
    with pytest.raises(ValueError, match="has not fired.*save_pretrained serves it as it is"):
        serve.to_qwen3(llama, dormant)
    other, _ = build("hf-llama")      # a guard of another model (of the same shape) says nothing of this one
    with pytest.raises(ValueError, match=r"to_qwen3 takes the guard attached to this model, covering all of its 2"):
        serve.to_qwen3(other, dormant)
    with pytest.raises(FileNotFoundError, match=r"has no qkguard.pt: save it with save_guard\(guard, folder\)"):
        serve.load_guard(model, tmp_path)


def fired_llama(**config):
    """A tiny Llama (test_attach's, with `config` changed) that the guard fired on, with its guard; by
    default qknorm in every layer."""
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, rms_norm_eps=1e-6), **config}))
    return model


def test_to_qwen3_refuses_each_llama_it_cannot_serve_in_one_line():
    """Each refusal, since an export past it serves another function: QK-norm in some layers only (a
    planted bug that dropped this refusal exported a model 0.19 off in its logits), the action in the
    weights already (QK-Clip), an MLP with biases (Qwen3's has none), an eps that is not Llama's."""
    x = batch()[0]
    cases = [({}, dict(scope="crossed"), r"QK-norm is on in layers \[0\] of 2 \(scope='crossed'\).*save_guard"),
             ({}, dict(action="qkclip", tau=1.0), r"action is qkclip, which is in the weights already"),
             (dict(mlp_bias=True), {}, r"mlp_bias=True, which Qwen3's MLP lacks: use save_guard"),
             (dict(rms_norm_eps=1e-4), {}, r"rms_norm_eps is 0.0001, not one of Llama's \(1e-06, 1e-05\).*strict=False")]
    for config, settings, refusal in cases:
        torch.manual_seed(0)
        model = fired_llama(**config)
        inflate_qk(model)
        if settings.get("scope") == "crossed":          # only layer 0 crosses
            with torch.no_grad():
                model.model.layers[1].self_attn.q_proj.weight.mul_(1 / 900)
        guard = qkguard.attach(model, threshold=20.0, **settings)
        for _ in range(2):
            model(input_ids=x, labels=x).loss.backward()
            guard.step()
        assert guard.triggered
        with pytest.raises(ValueError, match=rf"^serve: .*{refusal}"):
            serve.to_qwen3(model, guard)
        guard.detach()


def test_to_qwen3_takes_llama_3s_eps_close_not_bit_for_bit():
    """rms_norm_eps 1e-5 (Llama 3's): exported, its logits within 5e-4 of the guarded Llama's (QK_NORM_EPS
    1e-6 in the guard, 1e-5 in Qwen3's q_norm, k_norm), and not equal: the tolerance is real. At the
    initial weights (std 0.02), where q and k are smallest and the eps weighs most: 1.1e-4 measured."""
    torch.manual_seed(0)
    model = fired_llama(rms_norm_eps=1e-5)
    guard = qkguard.attach(model, threshold=1e-30)       # fired at the first check
    x = batch()[0]
    for _ in range(2):
        model(input_ids=x, labels=x).loss.backward()
        guard.step()
    assert guard.triggered
    qwen3 = serve.to_qwen3(model.eval(), guard)
    guarded, exported = logits(model, x), logits(qwen3, x)
    difference = (guarded - exported).abs().max().item()
    print(f"eps 1e-5: max |logit difference| {difference:.2e}")
    assert 0 < difference < 5e-4


def test_load_best_model_at_end_brings_back_the_guard_saved_with_those_weights(tmp_path):
    """The best checkpoint here is the first (greater_is_better on the eval loss, which falls), saved before the
    guard fired: the model ends with that checkpoint's weights and, since on_train_end, its unfired guard
    (it kept the final latch: QK-norm on weights trained without it)."""
    transformers.set_seed(0)
    model, _ = build("hf-llama")
    inflate_qk(model, 8.0)
    guard = qkguard.attach(model, threshold=3.0)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4,
                                          learning_rate=1e-3, eval_strategy="steps", eval_steps=1, save_steps=1,
                                          load_best_model_at_end=True, metric_for_best_model="loss",
                                          greater_is_better=True, report_to="none", use_cpu=True, seed=0,
                                          disable_tqdm=True, dataloader_num_workers=0)
    callback = QKGuardCallback(guard)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens(n=8),
                                   callbacks=[callback])
    trainer.train()
    best = trainer.state.best_model_checkpoint
    saved = torch.load(os.path.join(best, STATE_FILE), weights_only=True)["state"]
    assert best.endswith("checkpoint-1") and saved["guard"]["trigger"] is None, best
    assert callback.events and callback.events[0]["active_from"] > 1, "it fired after that checkpoint"
    assert not guard.triggered and not any(switch.qk_norm for switch in guard.attentions)

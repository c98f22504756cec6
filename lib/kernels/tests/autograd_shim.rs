//! The C++ autograd shim on CPU: custom functions calling back into Rust, backward with explicit
//! output gradients, recompute, and generator snapshots. Gradients are checked numerically.

use anyhow::Result;
use megatron_kernels::autograd::{self, gradcheck::gradcheck, CustomFunction, SavedTensors};
use megatron_kernels::rng::RngSnapshot;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tch::{Device, Kind, Tensor};

/// libtorch's default generator is process-global and the test harness runs tests on parallel
/// threads: a test drawing random numbers would shift another's dropout replay. Every test here
/// holds this lock.
fn serial() -> MutexGuard<'static, ()> {
    static GENERATOR: Mutex<()> = Mutex::new(());
    GENERATOR
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn input(shape: &[i64]) -> Tensor {
    Tensor::randn(shape, (Kind::Double, Device::Cpu)).set_requires_grad(true)
}

/// y = x * sin(x) with a hand-written backward that uses the saved input.
struct XSinX;

impl CustomFunction for XSinX {
    fn forward(&mut self, inputs: &[Tensor], saved: &mut SavedTensors) -> Result<Vec<Tensor>> {
        saved.save(&inputs[0]);
        Ok(vec![&inputs[0] * inputs[0].sin()])
    }
    fn backward(&mut self, grads: &[Tensor], saved: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let x = &saved[0];
        Ok(vec![Some(&grads[0] * (x.sin() + x * x.cos()))])
    }
}

/// (a * b, a + 2b): two inputs, two outputs, the product saved for backward.
struct ProductAndSum;

impl CustomFunction for ProductAndSum {
    fn forward(&mut self, inputs: &[Tensor], saved: &mut SavedTensors) -> Result<Vec<Tensor>> {
        let (a, b) = (&inputs[0], &inputs[1]);
        saved.save(a);
        saved.save(b);
        Ok(vec![a * b, a + b * 2.0])
    }
    fn backward(&mut self, grads: &[Tensor], saved: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let (a, b) = (&saved[0], &saved[1]);
        let (g_prod, g_sum) = (&grads[0], &grads[1]);
        Ok(vec![
            Some(g_prod * b + g_sum),
            Some(g_prod * a + g_sum * 2.0),
        ])
    }
}

/// Identity forward, gradient multiplied by `ranks` in backward: the shape of Megatron's
/// copy-to-tensor-parallel-region, whose backward all-reduces over `ranks` equal replicas.
struct CopyToRegion {
    ranks: f64,
}

impl CustomFunction for CopyToRegion {
    fn forward(&mut self, inputs: &[Tensor], _: &mut SavedTensors) -> Result<Vec<Tensor>> {
        Ok(vec![inputs[0].shallow_clone()])
    }
    fn backward(&mut self, grads: &[Tensor], _: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(&grads[0] * self.ranks)])
    }
}

#[test]
fn custom_function_gradient_matches_finite_differences() -> Result<()> {
    let _serial = serial();
    tch::manual_seed(0);
    let x = input(&[3, 4]);
    let y = &autograd::apply(XSinX, &[&x])?[0];
    assert!(
        y.allclose(&(&x * x.sin()), 1e-12, 1e-12, false),
        "forward value"
    );
    gradcheck(
        |xs| Ok(autograd::apply(XSinX, &[&xs[0]])?),
        &[x],
        1e-6,
        1e-7,
        1e-6,
    )
}

#[test]
fn several_inputs_and_outputs_match_finite_differences() -> Result<()> {
    let _serial = serial();
    tch::manual_seed(1);
    let inputs = [input(&[5]), input(&[5])];
    gradcheck(
        |xs| Ok(autograd::apply(ProductAndSum, &[&xs[0], &xs[1]])?),
        &inputs,
        1e-6,
        1e-7,
        1e-6,
    )
}

#[test]
fn gradcheck_rejects_a_wrong_backward() {
    let _serial = serial();
    struct WrongBackward;
    impl CustomFunction for WrongBackward {
        fn forward(&mut self, inputs: &[Tensor], _: &mut SavedTensors) -> Result<Vec<Tensor>> {
            Ok(vec![inputs[0].square()])
        }
        fn backward(&mut self, grads: &[Tensor], _: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
            Ok(vec![Some(grads[0].shallow_clone())])
        }
    }
    tch::manual_seed(2);
    let result = gradcheck(
        |xs| Ok(autograd::apply(WrongBackward, &[&xs[0]])?),
        &[input(&[4])],
        1e-6,
        1e-7,
        1e-6,
    );
    let message = result
        .expect_err("a wrong backward must be caught")
        .to_string();
    assert!(message.contains("gradient mismatch"), "{message}");
}

#[test]
fn region_backward_reaches_earlier_layers_through_the_graph() -> Result<()> {
    let _serial = serial();
    tch::manual_seed(3);
    let w = input(&[4, 4]);
    let x = Tensor::randn([2, 4], (Kind::Double, Device::Cpu));
    let hidden = x.matmul(&w);
    let copied = &autograd::apply(CopyToRegion { ranks: 3.0 }, &[&hidden])?[0];
    copied.sum(Kind::Double).backward();
    // d(sum(x W))/dW = x^T 1, scaled by the region's backward.
    let expected = x
        .transpose(0, 1)
        .matmul(&Tensor::ones([2, 4], (Kind::Double, Device::Cpu)))
        * 3.0;
    assert!(w.grad().allclose(&expected, 1e-12, 1e-12, false));
    Ok(())
}

#[test]
fn backward_with_explicit_output_gradient_accumulates_into_leaves() -> Result<()> {
    let _serial = serial();
    tch::manual_seed(4);
    let w = input(&[3, 5]);
    let x = Tensor::randn([5, 2], (Kind::Double, Device::Cpu));
    let y = w.matmul(&x);
    let g = Tensor::randn([3, 2], (Kind::Double, Device::Cpu));
    autograd::backward(&[&y], &[&g], true)?;
    assert!(w
        .grad()
        .allclose(&g.matmul(&x.transpose(0, 1)), 1e-12, 1e-12, false));
    // A second backward through the retained graph accumulates.
    autograd::backward(&[&y], &[&g], false)?;
    assert!(w
        .grad()
        .allclose(&(g.matmul(&x.transpose(0, 1)) * 2.0), 1e-12, 1e-12, false));
    Ok(())
}

#[test]
fn grad_reports_unused_inputs_as_none() -> Result<()> {
    let _serial = serial();
    let a = input(&[3]);
    let unused = input(&[3]);
    let y = a.square();
    let grads = autograd::grad(&[&y], &[&y.ones_like()], &[&a, &unused], false, false)?;
    assert!(grads[0]
        .as_ref()
        .unwrap()
        .allclose(&(&a * 2.0), 1e-12, 1e-12, false));
    assert!(grads[1].is_none());
    Ok(())
}

#[test]
fn callback_errors_and_panics_become_errors() {
    let _serial = serial();
    struct Failing {
        panic: bool,
    }
    impl CustomFunction for Failing {
        fn forward(&mut self, inputs: &[Tensor], _: &mut SavedTensors) -> Result<Vec<Tensor>> {
            Ok(vec![inputs[0].shallow_clone()])
        }
        fn backward(&mut self, _: &[Tensor], _: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
            if self.panic {
                panic!("stage 3 lost its peer");
            }
            anyhow::bail!("reduce-scatter timed out")
        }
    }
    for (panic, expected) in [
        (false, "reduce-scatter timed out"),
        (true, "stage 3 lost its peer"),
    ] {
        let x = input(&[2]);
        let y = &autograd::apply(Failing { panic }, &[&x]).unwrap()[0];
        let err = autograd::backward(&[y], &[&y.ones_like()], false).unwrap_err();
        assert!(err.0.contains(expected), "{err}");
    }
}

#[test]
fn wrong_gradient_count_is_an_error() {
    let _serial = serial();
    struct TooFew;
    impl CustomFunction for TooFew {
        fn forward(&mut self, inputs: &[Tensor], _: &mut SavedTensors) -> Result<Vec<Tensor>> {
            Ok(vec![&inputs[0] + &inputs[1]])
        }
        fn backward(&mut self, grads: &[Tensor], _: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
            Ok(vec![Some(grads[0].shallow_clone())])
        }
    }
    let (a, b) = (input(&[2]), input(&[2]));
    let y = &autograd::apply(TooFew, &[&a, &b]).unwrap()[0];
    let err = autograd::backward(&[y], &[&y.ones_like()], false).unwrap_err();
    assert!(err.0.contains("returned 1 gradients for 2 inputs"), "{err}");
}

#[test]
fn rust_state_is_dropped_exactly_once_when_the_graph_goes() -> Result<()> {
    let _serial = serial();
    struct Counted(Arc<AtomicUsize>);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    impl CustomFunction for Counted {
        fn forward(&mut self, inputs: &[Tensor], _: &mut SavedTensors) -> Result<Vec<Tensor>> {
            Ok(vec![&inputs[0] * 2.0])
        }
        fn backward(&mut self, grads: &[Tensor], _: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
            Ok(vec![Some(&grads[0] * 2.0)])
        }
    }
    let drops = Arc::new(AtomicUsize::new(0));
    let x = input(&[2]);
    let y = autograd::apply(Counted(drops.clone()), &[&x])?;
    assert_eq!(
        drops.load(Ordering::SeqCst),
        0,
        "the graph still holds the function"
    );
    drop(y);
    assert_eq!(drops.load(Ordering::SeqCst), 1);

    let untracked = x.detach();
    let y = autograd::apply(Counted(drops.clone()), &[&untracked])?;
    assert_eq!(
        drops.load(Ordering::SeqCst),
        2,
        "no graph is recorded without requires_grad"
    );
    assert!(!y[0].requires_grad());
    Ok(())
}

#[test]
fn checkpoint_gives_the_gradients_of_the_plain_block_dropout_included() -> Result<()> {
    let _serial = serial();
    let w1 = input(&[6, 8]);
    let w2 = input(&[8, 6]);
    let x = Tensor::randn([4, 6], (Kind::Double, Device::Cpu)).set_requires_grad(true);
    let block = |w1: &Tensor, w2: &Tensor| {
        let (w1, w2) = (w1.shallow_clone(), w2.shallow_clone());
        move |xs: &[Tensor]| -> Result<Vec<Tensor>> {
            let h = xs[0].matmul(&w1).gelu("none").dropout(0.3, true);
            Ok(vec![h.matmul(&w2)])
        }
    };
    let plain = block(&w1, &w2);
    let upstream = Tensor::randn([4, 6], (Kind::Double, Device::Cpu));

    tch::manual_seed(42);
    let y_ref = &plain(&[x.shallow_clone()])?[0];
    autograd::backward(&[y_ref], &[&upstream], false)?;
    let reference: Vec<Tensor> = [&x, &w1, &w2].iter().map(|t| t.grad().copy()).collect();
    for t in [&x, &w1, &w2] {
        let _ = t.grad().zero_();
    }

    tch::manual_seed(42);
    let y = &autograd::recompute(block(&w1, &w2), &[&x])?[0];
    // Draw random numbers between forward and backward: recompute must not depend on them.
    let _ = Tensor::rand([100], (Kind::Float, Device::Cpu));
    assert!(
        y.allclose(y_ref, 0.0, 0.0, false),
        "checkpointed forward equals the plain forward"
    );
    autograd::backward(&[y], &[&upstream], false)?;
    for (name, (t, expected)) in ["x", "w1", "w2"]
        .iter()
        .zip([&x, &w1, &w2].iter().zip(&reference))
    {
        assert!(
            t.grad().allclose(expected, 1e-12, 1e-12, false),
            "gradient of {name}"
        );
    }
    Ok(())
}

#[test]
fn rng_snapshot_replays_random_numbers() -> Result<()> {
    let _serial = serial();
    tch::manual_seed(7);
    let snapshot = RngSnapshot::capture([Device::Cpu])?;
    let first = Tensor::rand([16], (Kind::Float, Device::Cpu));
    let second = Tensor::rand([16], (Kind::Float, Device::Cpu));
    assert!(!first.allclose(&second, 0.0, 0.0, false));
    snapshot.restore()?;
    let replay = Tensor::rand([16], (Kind::Float, Device::Cpu));
    assert!(first.allclose(&replay, 0.0, 0.0, false));
    Ok(())
}

//! The row argmax kernels (greedy decoding's token): on a GPU they answer as libtorch's `argmax(-1)` on
//! random rows with ties, -inf and NaN, in bf16, fp16 and fp32, contiguous and strided, from 1
//! to 64 rows of 1 to 128,256 values.

use megatron_kernels::ops::argmax::{argmax_rows, greedy};
use tch::{Device, Kind, Tensor};

#[test]
fn the_argmax_kernels_answer_as_libtorch_on_a_gpu() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    tch::manual_seed(5);
    let device = Device::Cuda(0);
    for kind in [Kind::BFloat16, Kind::Half, Kind::Float] {
        for (rows, columns) in [
            (1, 50257),
            (3, 4096),
            (64, 50257),
            (5, 128256),
            (2, 1),
            (7, 4097),
        ] {
            // Rounded to a few values so that rows have ties; a padded row, as logits are
            // narrowed from the padded vocabulary.
            let padded = (Tensor::randn([rows, columns + 47], (Kind::Float, device)) * 4.0)
                .round()
                .to_kind(kind);
            let x = padded.narrow(1, 0, columns);
            let mut cases = vec![x.shallow_clone()];
            // Rows of -inf (every index ties), and NaN in some rows, the first NaN winning.
            let special = x.copy();
            let _ = special.get(0).fill_(f64::NEG_INFINITY);
            if rows > 2 {
                let _ = special.get(1).narrow(0, columns / 2, 1).fill_(f64::NAN);
                let _ = special.get(2).narrow(0, columns - 1, 1).fill_(f64::NAN);
                let _ = special.get(2).narrow(0, columns / 3, 1).fill_(f64::NAN);
            }
            cases.push(special);
            for case in cases {
                let want = case.argmax(-1, false);
                let got = argmax_rows(&case).unwrap();
                assert!(
                    got.equal(&want),
                    "{kind:?} {rows}x{columns}: {:?} against libtorch's {:?}",
                    Vec::<i64>::try_from(got.to_device(Device::Cpu)).unwrap(),
                    Vec::<i64>::try_from(want.to_device(Device::Cpu)).unwrap()
                );
                assert!(greedy(&case).unwrap().equal(&want));
            }
        }
    }
    // A column-strided view is copied first; the answer stays libtorch's.
    let x = Tensor::randn([4, 1000], (Kind::Float, device)).tr();
    assert!(argmax_rows(&x).unwrap().equal(&x.argmax(-1, false)));
}

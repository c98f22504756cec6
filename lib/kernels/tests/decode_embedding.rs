//! The decode embedding kernel (a decode step's word and position lookups and their sum as one
//! kernel): on a GPU it gives the bits of libtorch's lookups and add, with and without position embeddings, in
//! bf16, fp16 and fp32, for 1 to 64 rows and hidden sizes that are not whole vectors; a token
//! outside the table gives a row of NaN, not a read out of bounds.

use megatron_kernels::ops::decode_embedding::{embed, reference, usable};
use tch::{Device, Kind, Tensor};

#[test]
fn the_decode_embedding_kernel_equals_libtorchs_lookups_on_a_gpu() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    tch::manual_seed(11);
    let device = Device::Cuda(0);
    for kind in [Kind::BFloat16, Kind::Half, Kind::Float] {
        for (vocabulary, places, hidden, rows) in [
            (50304, 1024, 1024, 1),
            (1000, 64, 72, 8),
            (333, 17, 1001, 64),
        ] {
            let words = Tensor::randn([vocabulary, hidden], (Kind::Float, device)).to_kind(kind);
            let table = Tensor::randn([places, hidden], (Kind::Float, device)).to_kind(kind);
            // The table's last rows included, and repeated tokens.
            let tokens = Tensor::randint(vocabulary, [rows, 1], (Kind::Int64, device));
            let _ = tokens.get(0).fill_(vocabulary - 1);
            let positions = Tensor::randint(places, [rows, 1], (Kind::Int64, device));
            let _ = positions.get(0).fill_(places - 1);
            for places in [Some(&table), None] {
                assert!(usable(&words, places), "{kind:?}");
                let got = embed(&words, places, &tokens, &positions).unwrap();
                let want = reference(&words, places, &tokens, &positions);
                assert_eq!(got.size(), [1, rows, hidden]);
                assert!(
                    got.equal(&want),
                    "{kind:?} {vocabulary}x{hidden}, {rows} rows, positions {}",
                    places.is_some()
                );
            }
        }
    }
    // A token past the table: its row is NaN, the others are looked up.
    let words = Tensor::randn([10, 64], (Kind::Float, device));
    let tokens = Tensor::from_slice(&[3i64, 10, -1])
        .to_device(device)
        .view([3, 1]);
    let positions = tokens.zeros_like();
    let got = embed(&words, None, &tokens, &positions).unwrap().get(0);
    assert!(got.get(0).equal(&words.get(3)));
    assert!(bool::try_from(got.narrow(0, 1, 2).isnan().all()).unwrap());
}

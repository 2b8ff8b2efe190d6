use ferrovod::runtime::entry::{InputMem, OutputMem};
use ferrovod::runtime::{self, OpSpec, TensorSpec};
use ferrovod::{DataType, OpKind, ReduceOp};
use std::time::Instant;
fn main() {
    runtime::init(Default::default()).unwrap();
    let rt = runtime::runtime().unwrap();
    let n = 161;
    let mut bufs: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; 4096]).collect();
    let names: Vec<String> = (0..n).map(|i| format!("g.{i}")).collect();
    let mut best = f64::MAX;
    for _step in 0..2000 {
        let t = Instant::now();
        let hs: Vec<_> = bufs
            .iter_mut()
            .enumerate()
            .map(|(i, b)| {
                let mut spec = OpSpec::new(
                    OpKind::Allreduce,
                    vec![TensorSpec {
                        name: names[i].clone(),
                        dtype: DataType::F32,
                        shape: vec![1024],
                        input: InputMem::Borrowed(unsafe {
                            ferrovod::transport::memory::HostBuffer::from_raw(
                                b.as_mut_ptr(),
                                b.len(),
                            )
                        }),
                        output: OutputMem::InPlace,
                        splits: None,
                    }],
                );
                spec.reduce_op = ReduceOp::Average;
                rt.enqueue(spec).unwrap()
            })
            .collect();
        let sub = t.elapsed().as_secs_f64();
        best = best.min(sub);
        for h in hs {
            h.wait(None).unwrap();
            rt.handles.release(h.id).unwrap();
        }
    }
    println!(
        "best submit {:.1} us ({:.3} us/op)",
        best * 1e6,
        best * 1e6 / n as f64
    );
    runtime::shutdown();
}

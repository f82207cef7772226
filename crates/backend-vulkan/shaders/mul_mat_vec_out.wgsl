// The decode mat-vec's store: result element `i` is the product `s` itself.

fn out_d(i: u32, s: f32) {
    st_d(i, s);
}

module @jit_flat attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<1x16x16x3xf32>, %arg1: tensor<8xf32>, %arg2: tensor<3x3x3x8xf32>, %arg3: tensor<10xf32>, %arg4: tensor<8x10xf32>) -> (tensor<1x10xf32> {jax.result_info = "result[0]"}) {
    %0 = stablehlo.convolution(%arg0, %arg2) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {stride = [1, 1], pad = [[1, 1], [1, 1]], lhs_dilate = [1, 1], rhs_dilate = [1, 1], reverse = [false, false]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64, precision_config = [#stablehlo<precision DEFAULT>, #stablehlo<precision DEFAULT>]} : (tensor<1x16x16x3xf32>, tensor<3x3x3x8xf32>) -> tensor<1x16x16x8xf32>
    %1 = stablehlo.broadcast_in_dim %arg1, dims = [3] : (tensor<8xf32>) -> tensor<1x1x1x8xf32>
    %2 = stablehlo.broadcast_in_dim %1, dims = [0, 1, 2, 3] : (tensor<1x1x1x8xf32>) -> tensor<1x16x16x8xf32>
    %3 = stablehlo.add %0, %2 : tensor<1x16x16x8xf32>
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %4 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<1x16x16x8xf32>
    %5 = stablehlo.maximum %3, %4 : tensor<1x16x16x8xf32>
    %cst_0 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %6 = stablehlo.reduce(%5 init: %cst_0) applies stablehlo.add across dimensions = [1, 2] : (tensor<1x16x16x8xf32>, tensor<f32>) -> tensor<1x8xf32>
    %cst_1 = stablehlo.constant dense<2.560000e+02> : tensor<f32>
    %7 = stablehlo.broadcast_in_dim %cst_1, dims = [] : (tensor<f32>) -> tensor<1x8xf32>
    %8 = stablehlo.divide %6, %7 : tensor<1x8xf32>
    %9 = stablehlo.dot_general %8, %arg4, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<1x8xf32>, tensor<8x10xf32>) -> tensor<1x10xf32>
    %10 = stablehlo.broadcast_in_dim %arg3, dims = [1] : (tensor<10xf32>) -> tensor<1x10xf32>
    %11 = stablehlo.add %9, %10 : tensor<1x10xf32>
    return %11 : tensor<1x10xf32>
  }
}

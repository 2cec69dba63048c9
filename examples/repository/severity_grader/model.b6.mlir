module @jit_flat attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<6x224x224xui8>, %arg1: tensor<9xf32>, %arg2: tensor<784x9xf32>) -> (tensor<6x9xf32> {jax.result_info = "result[0]"}) {
    %0 = stablehlo.convert %arg0 : (tensor<6x224x224xui8>) -> tensor<6x224x224xf32>
    %cst = stablehlo.constant dense<2.550000e+02> : tensor<f32>
    %1 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<6x224x224xf32>
    %2 = stablehlo.divide %0, %1 : tensor<6x224x224xf32>
    %cst_0 = stablehlo.constant dense<5.000000e-01> : tensor<f32>
    %3 = stablehlo.broadcast_in_dim %cst_0, dims = [] : (tensor<f32>) -> tensor<6x224x224xf32>
    %4 = stablehlo.subtract %2, %3 : tensor<6x224x224xf32>
    %5 = stablehlo.reshape %4 : (tensor<6x224x224xf32>) -> tensor<6x28x8x28x8xf32>
    %cst_1 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %6 = stablehlo.reduce(%5 init: %cst_1) applies stablehlo.add across dimensions = [2, 4] : (tensor<6x28x8x28x8xf32>, tensor<f32>) -> tensor<6x28x28xf32>
    %cst_2 = stablehlo.constant dense<6.400000e+01> : tensor<f32>
    %7 = stablehlo.broadcast_in_dim %cst_2, dims = [] : (tensor<f32>) -> tensor<6x28x28xf32>
    %8 = stablehlo.divide %6, %7 : tensor<6x28x28xf32>
    %9 = stablehlo.reshape %8 : (tensor<6x28x28xf32>) -> tensor<6x784xf32>
    %10 = stablehlo.dot_general %9, %arg2, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<6x784xf32>, tensor<784x9xf32>) -> tensor<6x9xf32>
    %11 = stablehlo.broadcast_in_dim %arg1, dims = [1] : (tensor<9xf32>) -> tensor<1x9xf32>
    %12 = stablehlo.broadcast_in_dim %11, dims = [0, 1] : (tensor<1x9xf32>) -> tensor<6x9xf32>
    %13 = stablehlo.add %10, %12 : tensor<6x9xf32>
    return %13 : tensor<6x9xf32>
  }
}
